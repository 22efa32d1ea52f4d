"""Checkpoints through the train command: bit-exact resume after SIGKILL, SIGINT and
SIGTERM saving and exiting, non-finite steps rolled back."""

import json
import re
import signal
import subprocess
import sys
import time

import chex
import numpy as np
import pytest
from support.faults import corrupt_arrays
from support.runs import ROOT, checkpoint_params, device_env, metrics, run, train_command


def _cli(workdir, *overrides, faults: dict | None = None, check=True):
    """The train command; with `faults`, run by tests/support/faults.py with that fault plan. The
    module's runs share a compilation cache of their own, which its first run fills."""
    cache = f"--config.train.compile_cache={workdir.parent / 'xla-cache'}"
    command = train_command(workdir, "--config.checkpoint.every_steps=4", "--config.parallel.data=8", cache, *overrides)
    if faults is not None:
        command = [sys.executable, str(ROOT / "tests" / "support" / "faults.py"), json.dumps(faults), *command[3:]]
    return run(command, check=check)


def _losses(workdir):
    return [(m["step"], m["loss"]) for m in metrics(workdir)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cli") / "full"
    (workdir.parent / "full.out").write_text(_cli(workdir).stdout)
    return workdir


def _programs(out: str) -> tuple[int, int]:
    """A run's programs read back from its compilation cache, and compiled."""
    read, compiled = re.search(r"compilation cache .*: (\d+) programs read back, (\d+) compiled", out).groups()
    return int(read), int(compiled)


# (fault plan, step the resume restores): checkpoints fall every 4 steps.
KILLS = {
    "before the first checkpoint": ({"kill_at_step": 3}, None),
    # Checkpoints 4 and 8 hold different states; 8 is corrupted before the resume, which must move
    # it aside, restore 4 and later save a new step 8.
    "between checkpoints, latest corrupt": ({"kill_at_step": 9}, 4),
    "during an async save": ({"kill_at_step": 8, "kill_during_save": True}, 4),
}


@pytest.mark.parametrize("kill,restores", KILLS.values(), ids=KILLS.keys())
def test_sigkill_and_resume_is_bit_identical(uninterrupted, kill, restores):
    workdir = uninterrupted.parent / ("killed" + "".join(str(v) for v in kill.values()))
    proc = _cli(workdir, faults=kill, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    directory = workdir / "checkpoints"
    if kill.get("kill_during_save"):
        assert list(directory.glob("8.orbax-checkpoint-tmp*")), "the kill should leave a partial save of step 8"
    if kill == {"kill_at_step": 9}:
        assert (directory / "4").is_dir()
        corrupt_arrays(directory / "8")
    resumed = _cli(workdir)
    if restores is None:
        assert "checkpoint: restored step" not in resumed.stdout
        # What the uninterrupted run compiled (into a cache it found empty), the resume reads back.
        fresh = _programs((uninterrupted.parent / "full.out").read_text())
        assert fresh[0] == 0 and fresh[1] > 0 and _programs(resumed.stdout) == (fresh[1], 0), resumed.stdout[-2000:]
    else:
        assert f"checkpoint: restored step {restores} " in resumed.stdout
    if kill == {"kill_at_step": 9}:
        assert (directory / "8.unreadable").is_dir() and (directory / "8").is_dir()  # moved aside, saved anew
    assert _losses(workdir) == _losses(uninterrupted)  # bit-identical, and cut back to one clean run
    chex.assert_trees_all_equal(checkpoint_params(workdir, 12), checkpoint_params(uninterrupted, 12))


def _logged(workdir) -> int:
    path = workdir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _preempt(command, workdir, sig) -> tuple[str, int]:
    """Starts `command`, sends it `sig` once it has logged a step (so its handlers are in place),
    checks that it exits 0; returns its output and the step it saved and stopped at."""
    before = _logged(workdir)
    popen = dict(cwd=ROOT, env=device_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc, deadline = subprocess.Popen(command, **popen), time.time() + 300
    while _logged(workdir) <= before:
        assert time.time() < deadline and proc.poll() is None, "training never logged a step"
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert f"{sig.name} received: saving a checkpoint and stopping after this step" in out
    return out, int(out.split("preempted: checkpoint saved at step ")[1].split(";")[0])


def test_sigint_then_sigterm_save_at_the_step_exit_0_and_resume(uninterrupted):
    """Ctrl-C (SIGINT) stops the run at the next step boundary with a checkpoint of that step and
    exit status 0; the same command resumes from it, and a scheduler's SIGTERM does the same there."""
    workdir = uninterrupted.parent / "preempted"
    command = train_command(workdir, "--config.train.steps=400", "--config.checkpoint.every_steps=1000")
    _, interrupted = _preempt(command, workdir, signal.SIGINT)
    assert _saved_steps(workdir) == [interrupted]
    out, terminated = _preempt(command, workdir, signal.SIGTERM)
    assert f"checkpoint: restored step {interrupted} " in out
    assert terminated > interrupted and _saved_steps(workdir) == [interrupted, terminated]
    steps = [step for step, _ in _losses(workdir)]
    assert steps == sorted(set(steps)) and steps[-1] == terminated  # one run, cut back at the restore


def _saved_steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())


def test_non_finite_steps_are_skipped_then_rolled_back(uninterrupted):
    workdir = uninterrupted.parent / "nan"
    proc = _cli(workdir, "--config.checkpoint.max_bad_steps=2", faults={"nan_at_steps": [3, 6, 7]})
    out = proc.stdout
    assert "step 3: non-finite loss or gradients, update skipped (1 in a row)" in out
    assert "step 7: back to the params of step 4; the batches since are skipped" in out
    last = metrics(workdir)[-1]
    assert last["step"] == 12 and last["skipped_total"] == 3 and np.isfinite(last["loss"])
