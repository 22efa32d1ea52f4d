"""When the launcher counts a process as hung, from the heartbeat file the process writes: a step's
timeout after a step, the start-up timeout before the first step and during slow work the process
announced (an evaluation, which compiles the first time; the last save and the sample)."""

import os
import time

from jaxllm import heartbeat

STEP, STARTUP = 20.0, 600.0


def _age(directory, seconds: float) -> None:
    """The process's last beat, `seconds` ago."""
    then = time.time() - seconds
    os.utime(directory / "0", (then, then))


def _overdue(directory, started_ago: float = 0.0):
    return heartbeat.overdue(directory, 0, time.time() - started_ago, STEP, STARTUP)


def test_a_step_gets_the_step_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv(heartbeat.ENV, str(tmp_path))
    heartbeat.beat(6, 0)
    _age(tmp_path, STEP - 5)
    assert _overdue(tmp_path, started_ago=STARTUP * 2) is None
    _age(tmp_path, STEP + 5)
    assert _overdue(tmp_path) == "made no progress for 25 s since its last step"


def test_announced_slow_work_gets_the_startup_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv(heartbeat.ENV, str(tmp_path))
    heartbeat.beat(6, 0, slow="an evaluation")
    _age(tmp_path, STEP + 100)
    assert _overdue(tmp_path) is None
    _age(tmp_path, STARTUP + 5)
    assert _overdue(tmp_path) == "made no progress for 605 s since an evaluation"
    heartbeat.beat(6, 0)  # evaluated: back to the step's timeout
    _age(tmp_path, STEP + 5)
    assert _overdue(tmp_path) == "made no progress for 25 s since its last step"


def test_before_the_first_step_the_startup_timeout_counts_from_the_start(tmp_path):
    assert _overdue(tmp_path, started_ago=STARTUP - 5) is None
    assert _overdue(tmp_path, started_ago=STARTUP + 5) == "made no progress for 605 s since start (no step yet)"


def test_without_a_launcher_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(heartbeat.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    heartbeat.beat(1, 0, slow="an evaluation")
    assert list(tmp_path.iterdir()) == []
