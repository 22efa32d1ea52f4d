"""Multi-process training under the launcher (gloo collectives between local processes), worker
failures and hangs, and export."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import chex
import numpy as np
import psutil
import pytest
from support.runs import ROOT, checkpoint_params, metrics, run, start_until_first_step, train_command

from jaxllm.checkpoint import load_params

pytestmark = pytest.mark.minutes(7)  # about 7 min on 2 cores: scheduled first (tests/conftest.py)


def _train_command(workdir):
    return train_command(
        workdir, "--config.checkpoint.every_steps=4", "--config.parallel.data=4", "--config.parallel.fsdp=2"
    )


def _launch(workdir, *launcher_args, train_flags=()):
    return [sys.executable, "-m", "jaxllm.launch", "--nproc", "2", "--backoff", "1", *launcher_args, "--",
            *_train_command(workdir), *train_flags]  # fmt: skip


def _losses(workdir):
    return [(m["step"], m["loss"]) for m in metrics(workdir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same training as 1 process × 8 devices and as 2 processes × 4 devices, the latter logging
    JSON lines from both processes (its output in multi.out)."""
    root = tmp_path_factory.mktemp("launch")
    single, multi = root / "single", root / "multi"
    run(_train_command(single))
    proc = run(_launch(multi, train_flags=("--log-all-processes", "--log-json")), devices=4)
    assert "launch: all 2 processes finished" in proc.stdout
    (root / "multi.out").write_text(proc.stdout)
    return single, multi


def _records(output) -> list[dict]:
    """The JSON log records in a launch's output, each read from its `{"time"` on: within a worker
    Gloo writes some messages in pieces from native code, so a record may follow a first piece."""
    return [json.loads(line[line.index('{"time"') :]) for line in output.read_text().splitlines() if '{"time"' in line]


def test_two_processes_match_one(runs):
    single, multi = runs
    got, want = _losses(multi), _losses(single)
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(2, 13, 2))
    np.testing.assert_allclose([loss for _, loss in got], [loss for _, loss in want], rtol=1e-5)


def test_processes_on_cpu_turn_the_compilation_cache_off_alike(runs):
    """JAX on CPU keys a program differently in each process and only process 0 writes: with the
    cache on, a restarted process 0 would read back what process 1 compiles again, and outrun it
    past gloo's 30 s. So both processes compile, and say why."""
    _, multi = runs
    lines = _records(multi.parent / "multi.out")
    off = [r["process"] for r in lines if r["message"].startswith("compilation cache off: on this backend")]
    assert sorted(off) == [0, 1]
    assert not [r for r in lines if "programs read back" in r["message"]]


def test_with_log_all_processes_each_process_logs_json_lines(runs):
    """`--log-all-processes --log-json`: both processes announce the run, as JSON lines that name
    their process; without them only process 0 speaks (tests/e2e/test_slurm.py)."""
    _, multi = runs
    lines = _records(multi.parent / "multi.out")
    announced = [r["process"] for r in lines if r["message"].startswith('{\n  "model": {')]
    assert sorted(announced) == [0, 1]
    assert all(r["logger"].startswith("jaxllm.") and r["level"] in ("info", "warning") for r in lines)
    assert sum(r["message"].startswith("sample: ") for r in lines) == 1  # process 0 samples


def _run_and_disturb(workdir, disturb, *launcher_args):
    """Starts a 2-process launch, waits for its first logged step, disturbs one worker."""
    launcher = start_until_first_step(
        _launch(workdir, *launcher_args), workdir, devices=4, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    workers = [p for p in psutil.Process(launcher.pid).children() if "jaxllm.train" in " ".join(p.cmdline())]
    assert len(workers) == 2
    os.kill(workers[1].pid, disturb)
    out, _ = launcher.communicate(timeout=600)
    return launcher.returncode, out


def test_killed_worker_restarts_the_group_and_finishes_the_same(runs, tmp_path):
    code, out = _run_and_disturb(tmp_path / "killed", signal.SIGKILL)
    assert code == 0, out[-3000:]
    assert "launch: attempt 1 failed: process 1 exited with code -9" in out
    assert "launch: all 2 processes finished" in out
    assert _losses(tmp_path / "killed") == _losses(runs[1])  # as the uninterrupted 2-process run


def test_hung_worker_is_detected_within_the_timeout(tmp_path):
    code, out = _run_and_disturb(tmp_path / "hung", signal.SIGSTOP, "--heartbeat-timeout", "15")
    assert code == 0, out[-3000:]
    # The stopped worker, or its partner blocked in a collective: whichever the launcher sees first.
    failure = re.search(r"launch: attempt 1 failed: (.*)", out).group(1)  # a progress bar may share the line
    assert "made no progress for" in failure and failure.endswith("hung")
    assert int(failure.split("no progress for ")[1].split(" s")[0]) < 15 + 5
    assert "launch: all 2 processes finished" in out


def test_fast_tier_resumes_from_the_newest_step_every_process_holds(runs, tmp_path):
    """Fast-tier saves every 2 steps and no persistent ones: both processes are killed after step 9
    (holding fast-tier steps 6 and 8), process 1 then loses its step 8, and the run resumes from step
    6, the newest that both hold, bit-identical to the uninterrupted run."""
    workdir, local = tmp_path / "fast", tmp_path / "local"
    command = train_command(workdir, "--config.parallel.data=4", "--config.parallel.fsdp=2",
                            "--config.checkpoint.every_steps=100", f"--config.checkpoint.local_dir={local}",
                            "--config.checkpoint.local_every_steps=2")  # fmt: skip
    faulty = [sys.executable, str(ROOT / "tests" / "support" / "faults.py"), json.dumps({"kill_at_step": 9}),
              *command[3:]]  # fmt: skip
    launch = [sys.executable, "-m", "jaxllm.launch", "--nproc", "2", "--max-restarts", "0", "--heartbeat-timeout", "60",
              "--"]  # fmt: skip
    killed = run([*launch, *faulty], devices=4, check=False)
    assert killed.returncode == 1 and "exited with code -9" in killed.stdout, killed.stdout[-3000:]
    held = {p.name: sorted(int(s.name) for s in p.iterdir() if s.name.isdigit()) for p in local.iterdir()}
    assert held == {"process-0": [6, 8], "process-1": [6, 8]} and not (workdir / "checkpoints" / "8").exists()
    shutil.rmtree(local / "process-1" / "8")
    resumed = run([*launch, *command], devices=4)
    assert f"checkpoint: restored step 6 from the fast tier in {local}" in resumed.stdout, resumed.stdout[-3000:]
    assert _losses(workdir) == _losses(runs[1])


def test_export_writes_params_for_serving(runs, tmp_path):
    single, _ = runs
    run([sys.executable, "-m", "jaxllm.export", "--workdir", str(single), "--out", str(tmp_path / "export")])
    cfg, params, step = load_params(tmp_path / "export")
    assert step == 12 and "opt_state" not in params
    assert (cfg.model.hidden, cfg.parallel.data, cfg.parallel.fsdp) == (64, 4, 2)  # the run's own config
    chex.assert_trees_all_equal(params, checkpoint_params(single, 12))


def test_the_launcher_imports_no_jax():
    """It supervises processes that run JAX; a supervisor that loaded it would hold its threads
    and memory for nothing (import-linter's contract says the same of the source)."""
    probe = "import sys, jaxllm.launch; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


_WORKER = """
import os, pathlib, sys, time
me, meeting = os.environ["JAX_PROCESS_ID"], pathlib.Path(sys.argv[1])
(meeting / me).touch()
while len(list(meeting.iterdir())) < 2:
    time.sleep(0.01)
for i in range(300):  # both at once, a line in three writes as Gloo writes its own
    for piece in (f"[worker {me}] line ", f"{i}", " ends here\\n"):
        os.write(1, piece.encode())
time.sleep(1)
if me == "0":
    os.write(1, b"\\rtrain: 50%")  # a progress bar until its next redraw
    time.sleep(2)
    os.write(1, b"\\rtrain: 100%\\n")
else:
    time.sleep(1)
    os.write(1, b"[worker 1] during the bar\\n")
"""


def test_workers_lines_reach_the_launchers_output_whole(tmp_path):
    """Workers share the launcher's stdout, and what each writes in pieces (Gloo's messages) reaches
    it a whole line at a time; a partial line (a progress bar between redraws) is not held back, and
    another worker's line then starts on a line of its own."""
    command = [sys.executable, "-c", _WORKER, str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "jaxllm.launch", "--nproc", "2", "--", *command], cwd=ROOT,
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().split("\n")  # as written: a carriage return is no line end
    for me in "01":
        assert [line for line in lines if line.startswith(f"[worker {me}] line")] == [
            f"[worker {me}] line {i} ends here" for i in range(300)
        ]
    assert lines[600:603] == ["\rtrain: 50%", "[worker 1] during the bar", "\rtrain: 100%"]


_ENDLESS_LINE = """
import os, pathlib, sys, time
for _ in range(192):  # 3 MiB, never quiet for long
    os.write(1, b"x" * (1 << 14))
    time.sleep(0.005)
for _ in range(60):
    os.write(1, b"x")
    time.sleep(0.05)
pathlib.Path(sys.argv[1]).touch()
os.write(1, b"\\n")
"""


def test_a_line_without_end_goes_on_in_pieces(tmp_path):
    """A worker that writes a line without end, never pausing: the relay sends it on once it passes
    a MiB rather than holding it all."""
    ended = tmp_path / "ended"
    launcher = subprocess.Popen([sys.executable, "-m", "jaxllm.launch", "--nproc", "1", "--", sys.executable, "-c",
                                 _ENDLESS_LINE, str(ended)], cwd=ROOT, stdout=subprocess.PIPE)  # fmt: skip
    received = 0
    while received < 2 << 20:
        chunk = os.read(launcher.stdout.fileno(), 1 << 16)
        assert chunk, "the launcher ended early"
        received += len(chunk)
    assert not ended.exists(), "the line was held until it ended"
    rest = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 0 and received + rest.count(b"x") == 3 * (1 << 20) + 60
