"""The goodput account against a ledger worked out by hand: two attempts of one run, the first
killed after step 5 with its last checkpoint at step 3."""

import json
import os
import time

import pytest

from jaxllm.train.goodput import LEDGER, Ledger, account, format_account, process_start_time

A, B = "local:1:100.000", "local:2:120.000"
LINES = [
    (A, "start", 100.0), (A, "startup", 103.0), (A, "data", 104.0), (A, "restore", 104.5, {"step": 0}),
    (A, "startup", 110.0),  # the first step, compiled
    (A, "step", 111.0, {"step": 2}), (A, "step", 112.0, {"step": 3}), (A, "save", 112.5),
    (A, "step", 113.5, {"step": 4}), (A, "step", 114.5, {"step": 5}),  # then killed
    (B, "start", 120.0), (B, "startup", 125.0), (B, "restore", 126.0, {"step": 3}),
    (B, "startup", 130.0), (B, "step", 131.0, {"step": 5}), (B, "evaluate", 132.0), (B, "startup", 132.5),
]  # fmt: skip


def _write(workdir, lines) -> None:
    rows = [{"attempt": a, "what": w, "t": t, **(extra[0] if extra else {})} for a, w, t, *extra in lines]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (workdir / LEDGER).write_text(text + '{"attempt": "cut sho')  # a line cut short by a kill


def test_account_of_a_killed_and_resumed_run(tmp_path):
    _write(tmp_path, LINES)
    got = account(tmp_path)
    assert got["seconds"] == pytest.approx({
        "productive": 3.0,  # steps 2 and 3 of the first attempt, step 5 of the second
        "startup": 3.0 + 5.5 + 5.0 + 4.0 + 0.5, "data": 1.0, "restore": 0.5 + 1.0, "save": 0.5, "evaluate": 1.0,
        "lost": 2.0,  # steps 4 and 5 of the first attempt, after the checkpoint the second resumed from
        "waiting": 120.0 - 114.5,
    })  # fmt: skip
    assert got["lost_steps"] == 2 and got["attempts"] == 2
    assert got["wall"] == pytest.approx(32.5) and got["goodput"] == pytest.approx(3.0 / 32.5)
    assert sum(got["seconds"].values()) == pytest.approx(got["wall"])
    assert "goodput: 9.2% of 32.5 s wall" in format_account(got) and "(2 steps)" in format_account(got)


def test_attempts_are_ordered_by_their_start_not_by_the_file(tmp_path):
    """Lines reach the file in the order processes append them, which need not be the attempts'
    order (an attempt's exit mark comes after the next attempt started, on a shared file system
    with delayed writes): the account sorts the attempts by their start."""
    _write(tmp_path, LINES)
    in_order = account(tmp_path)
    _write(tmp_path, LINES[10:] + LINES[:10])
    assert account(tmp_path) == in_order


def test_ledger_writes_from_the_process_start_on_process_0_only(tmp_path):
    before = time.time()
    quiet = Ledger(tmp_path / "quiet", active=False)
    quiet.mark("startup")
    assert not (tmp_path / "quiet").exists()
    ledger = Ledger(tmp_path)
    ledger.mark("startup")
    ledger.mark("step", step=7)
    start, startup, step = (json.loads(line) for line in (tmp_path / LEDGER).read_text().splitlines())
    assert start["what"] == "start" and start["t"] < before  # the process started before the test did
    assert start["t"] == pytest.approx(process_start_time(), abs=0.05)
    assert startup["t"] <= step["t"] and step["step"] == 7 and start["attempt"].split(":")[1] == str(os.getpid())


def test_a_workdir_without_a_ledger_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not the workdir of a training run"):
        account(tmp_path)
