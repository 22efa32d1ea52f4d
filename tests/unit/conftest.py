"""The unit tier starts no process: whatever needs one (a command line, a server, a launcher) is a
test in tests/e2e. Starting one here fails the test and says where it belongs."""

import multiprocessing.process
import subprocess

import httpcore  # noqa: F401  imported here, before the guard: its import runs `ldconfig -p` (through trio)
import pytest


def _refuse(*args, **kwargs):
    raise AssertionError("a unit test started a process: move it to tests/e2e, where processes are started")


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
