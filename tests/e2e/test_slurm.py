"""The batch script on a real one-node SLURM cluster (tests/support/slurm.py starts and stops it):
2 tasks × 4 fake CPU devices train the tiny config as one job on a layout that crosses processes
(data 2 × fsdp 2 × tensor 2). Against a single-process 8-device run, and against itself through a
preemption (requeued), a killed task and a stopped one (each run again in the same allocation)."""

import os
import pathlib
import re
import sys
import threading
import time

import numpy as np
import psutil
import pytest
from support.runs import ROOT, metrics, run, train_command
from support.slurm import Cluster, unavailable
from support.xla_flags import xla_flags

from jaxllm.train.goodput import account

pytestmark = pytest.mark.minutes(9)  # about 9 min on 2 cores: scheduled first (tests/conftest.py)

STEPS = 12
LAYOUT = ("--config.parallel.data=2", "--config.parallel.fsdp=2", "--config.parallel.tensor=2")
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"


def _train_args(workdir, data_dir) -> list[str]:
    """The train command's arguments (after `python -m jaxllm.train`): every step logged."""
    overrides = ("--config.checkpoint.every_steps=4", f"--config.train.steps={STEPS}", "--config.train.log_every=1")
    return train_command(workdir, *LAYOUT, *overrides, data_dir=data_dir)[3:]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if why := unavailable():
        if os.environ.get("JAXLLM_REQUIRE_SLURM"):  # CI: these tests must run
            pytest.fail(f"JAXLLM_REQUIRE_SLURM is set, but {why}")
        pytest.skip(why)
    started = Cluster(tmp_path_factory.mktemp("slurm")).start()
    yield started
    started.stop()


class Job:
    """One submission of the batch script: 2 tasks on the one node, 4 fake CPU devices each, the
    venv's python found on the PATH it was submitted with."""

    def __init__(self, cluster: Cluster, workdir: pathlib.Path, data_dir, **env: str):
        self.cluster, self.workdir = cluster, workdir
        self.log = workdir.parent / f"{workdir.name}.out"
        env = {"XLA_FLAGS": xla_flags(4),
               "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}", **env}  # fmt: skip
        self.id = cluster.command(
            "sbatch", "--parsable", "--ntasks=2", "--ntasks-per-node=2", f"--output={self.log}", str(SBATCH),
            *_train_args(workdir, data_dir), env=env, cwd=ROOT,
        ).strip()  # fmt: skip

    def finish(self, timeout: float = 300) -> dict:
        """Waits for the job to end (a requeued one starts again once its credential expires: the test
        cluster's cred_expire is 10 s, SLURM's default 120 s); `scontrol show job`."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.cluster.job(self.id)
            if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {self.id} did not end within {timeout} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        # Two tasks' progress bars share the file: a character may be cut by the other's line.
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while not any(m["step"] >= step for m in _metrics(self.workdir)):
            assert time.time() < deadline, f"job {self.id} never logged step {step}:\n{self.output()[-3000:]}"
            time.sleep(0.1)

    def task(self, rank: int) -> psutil.Process:
        """The training process of SLURM task `rank`."""
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd[1:3] == ["-m", "jaxllm.train"] and str(self.workdir) in cmd and "--prepare-only" not in cmd:
                try:
                    if p.environ().get("SLURM_PROCID") == str(rank):
                        return p
                except psutil.NoSuchProcess:
                    continue
        raise AssertionError(f"no training process of task {rank} in job {self.id}")


class WallClock(threading.Thread):
    """Watches a workdir's training processes (data step included) from outside, every 0.1 s: from
    the first moment any is seen to the last."""

    def __init__(self, workdir: pathlib.Path):
        super().__init__(daemon=True)
        self.workdir, self.first, self.last, self.done = str(workdir), None, None, False
        self.start()

    def run(self) -> None:
        while not self.done:
            for p in psutil.process_iter(["cmdline"]):
                cmd = p.info["cmdline"] or []
                if cmd[1:3] == ["-m", "jaxllm.train"] and self.workdir in cmd:
                    self.first, self.last = self.first or time.time(), time.time()
            time.sleep(0.1)

    def stop(self) -> float:
        self.done = True
        self.join()
        return self.last - self.first


def _metrics(workdir) -> list[dict]:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return metrics(workdir) if path.exists() and path.read_text().endswith("\n") else []


def _losses(workdir) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in metrics(workdir)]


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The layout as one process with 8 devices (it prepares the data), and as an uninterrupted job."""
    root = tmp_path_factory.mktemp("slurm-runs")
    run(train_command(root / "single", *LAYOUT, f"--config.train.steps={STEPS}", "--config.train.log_every=1",
                      data_dir=root / "data"))  # fmt: skip
    job = Job(cluster, root / "plain", root / "data")
    info = job.finish()
    assert info["JobState"] == "COMPLETED", job.output()[-3000:]
    return root, job


def test_two_tasks_train_as_one_process_does(runs):
    root, job = runs
    got, want = _losses(job.workdir), _losses(root / "single")
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([loss for _, loss in got], [loss for _, loss in want], rtol=1e-5)
    out = job.output()
    assert out.count('"model": {') == 1 and out.count("sample:") == 1, "only process 0 announces and samples"
    assert "Involuntary full rematerialization" not in out


def test_sigterm_saves_requeues_and_resumes_bit_identical(runs, cluster):
    root, plain = runs
    job = Job(cluster, root / "preempted", root / "data")
    job.wait_for_step(6)
    cluster.command("scancel", "--signal=TERM", job.id)  # as SLURM does before a time limit or a preemption
    info = job.finish()
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out[-3000:]
    saved = re.findall(r"preempted: checkpoint saved at step (\d+)", out)
    assert len(saved) == 1 and f"checkpoint: restored step {saved[0]} " in out, out[-3000:]
    assert "requeued at" in out and "attempt 2:" in out
    assert _losses(job.workdir) == _losses(plain.workdir)


def test_killed_task_reruns_in_the_allocation_bit_identical_and_accounted(runs, cluster):
    root, plain = runs
    wall = WallClock(root / "killed")
    job = Job(cluster, root / "killed", root / "data")
    job.wait_for_step(6)
    victim = job.task(1)
    victim.suspend()  # the whole job stalls at its next collective: what process 0 logged is final
    time.sleep(2)
    reached = max(m["step"] for m in _metrics(job.workdir))
    victim.kill()
    info = job.finish()
    measured = wall.stop()
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", out[-3000:]
    assert "launch: attempt 1 failed: srun exited with code" in out, out[-3000:]
    assert _losses(job.workdir) == _losses(plain.workdir)
    restored = int(re.search(r"checkpoint: restored step (\d+)", out).group(1))
    goodput = account(job.workdir)
    assert goodput["lost_steps"] == reached - restored > 0
    assert goodput["attempts"] == 3  # the data step, the killed step, the rerun
    assert sum(goodput["seconds"].values()) == pytest.approx(goodput["wall"])
    # Seen from outside, the run also lasts through its last process's exit, after the ledger's last
    # line: seconds on a loaded machine, whatever the run's length.
    assert -0.5 < measured - goodput["wall"] < 5, (measured, goodput["wall"])


def test_stopped_task_is_detected_within_the_heartbeat_timeout(runs, cluster):
    root, plain = runs
    job = Job(cluster, root / "hung", root / "data", JAXLLM_HEARTBEAT_TIMEOUT="20")
    # Past the evaluation after step 6 (its compilation may outlast the 20 s, and has the start-up
    # timeout): the stopped task's last beat is then a step's.
    job.wait_for_step(7)
    job.task(1).suspend()
    info = job.finish()
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", out[-3000:]
    failure = re.search(r"launch: attempt 1 failed: (.*)", out).group(1)
    assert "made no progress for" in failure and failure.endswith("hung"), failure
    assert int(failure.split("no progress for ")[1].split(" s")[0]) < 20 + 5
    assert _losses(job.workdir) == _losses(plain.workdir)
