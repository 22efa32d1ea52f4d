"""jaxllm's one logger: plain lines on stdout with warnings and errors marked, process 0 of a job
only unless every process is asked for, JSON lines on request, and the process index from the
launcher's environment until JAX knows it."""

import json
import logging
import sys

import pytest
from tqdm import tqdm

from jaxllm import logs

log = logs.get("jaxllm.test")


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    monkeypatch.setattr(logs, "_settings", {"all_processes": False, "json": False, "process": None})
    for variable in ("JAX_PROCESS_ID", "SLURM_PROCID"):
        monkeypatch.delenv(variable, raising=False)


def test_plain_lines_with_warnings_and_errors_marked(capsys):
    log.info("checkpoint: restored step 4")
    log.warning("bubble_measured=0.4 is high")
    try:
        raise RuntimeError("the engine broke")
    except RuntimeError:
        log.exception("the engine stopped")
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["checkpoint: restored step 4", "warning: bubble_measured=0.4 is high"]
    assert out[2] == "error: the engine stopped"
    assert out[-1] == "RuntimeError: the engine broke"
    assert not logging.getLogger("jaxllm").propagate  # written once, whatever the root logger does


def test_only_process_0_logs_unless_every_process_is_asked_for(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "1")  # before JAX's start-up: the launcher's word
    log.info("from process 1, before start-up")
    logs.set_process(0)  # JAX's word wins
    log.info("from process 0")
    logs.set_process(3)
    log.info("from process 3")
    logs.configure(all_processes=True)
    log.info("from process 3, asked for")
    assert capsys.readouterr().out.splitlines() == ["from process 0", "from process 3, asked for"]


def test_json_lines_name_time_level_process_and_logger(capsys, monkeypatch):
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    logs.configure(all_processes=True, json_lines=True)
    log.warning('a message\nover two lines, "quoted"')
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record.keys() == {"time", "level", "process", "logger", "message"}
    assert (record["level"], record["process"], record["logger"]) == ("warning", 2, "jaxllm.test")
    assert record["message"] == 'a message\nover two lines, "quoted"'


class _Writes:
    """A stdout that keeps each write apart, as a pipe shared by processes sees them."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


def test_each_record_is_one_write_of_its_whole_line(monkeypatch):
    """A launch's workers share one pipe: a record written in pieces can be split by another's."""
    stdout = _Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    logs.configure(all_processes=True, json_lines=True)
    log.info("x" * 10_000)
    log.info("short")
    assert [json.loads(w)["message"] for w in stdout.writes] == ["x" * 10_000, "short"]
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in stdout.writes)


def test_a_line_logged_under_a_progress_bar_gets_a_line_of_its_own(capsys):
    bar = tqdm(total=3, file=sys.stdout, ascii=True, mininterval=0)
    bar.update(1)
    log.info("checkpoint: saved step 1")
    bar.update(1)
    bar.close()
    out = capsys.readouterr().out
    assert "\ncheckpoint: saved step 1\n" in out.replace("\r", "\n")


def test_quieted_as_any_python_logger(capsys):
    jaxllm = logging.getLogger("jaxllm")
    jaxllm.setLevel(logging.WARNING)
    try:
        log.info("checkpoint: saved step 1")
        log.warning("the loss is not finite")
    finally:
        jaxllm.setLevel(logging.INFO)
    assert capsys.readouterr().out.splitlines() == ["warning: the loss is not finite"]


def test_a_command_run_as_a_module_logs_as_jaxllm(capsys, monkeypatch):
    """`python -m jaxllm.launch`: the module's `__name__` is `__main__`; its logger is still
    jaxllm's child, named by the module's spec."""
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__spec__ = importlib.machinery.ModuleSpec("jaxllm.launch", None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    command = logs.get("__main__")
    command.info("launch: all 2 processes finished")
    assert command.name == "jaxllm.launch"
    assert capsys.readouterr().out == "launch: all 2 processes finished\n"
