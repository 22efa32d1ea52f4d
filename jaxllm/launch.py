"""Runs a JAX job's processes as one group and keeps it going: N local processes, or, inside a SLURM
allocation, one `srun` job step of all its tasks.

    python -m jaxllm.launch --nproc 2 [--max-restarts 3] -- python -m jaxllm.train --config ... --workdir DIR
    python -m jaxllm.launch --slurm --heartbeat-dir WORKDIR/heartbeat -- python -m jaxllm.train ...  # in sbatch

Each process writes a heartbeat file after every step it finishes (`jaxllm.heartbeat`). The
launcher ends the group and starts it again, with backoff, when any process exits with an error or
makes no progress for `--heartbeat-timeout` seconds (`--startup-timeout` until its first step,
which includes compilation and data preparation, and for an evaluation or the end of training,
which may compile too); training resumes from the last checkpoint. Locally, each process gets the
coordinator address, its process id and count; under SLURM, srun starts the tasks and JAX
reads them from SLURM's environment, and a rerun is a new job step in the same allocation.

Exit status: 0 when every process finished; 75 when the job was asked to stop (SIGTERM: preemption,
a time limit) and saved, so running it again (SLURM: requeueing it) resumes; 1 after the last restart.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from jaxllm import cli, heartbeat, logs

log = logs.get(__name__)

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: saved and stopped on request; run it again to resume
FINISHED, PREEMPTED = heartbeat.FINISHED, heartbeat.PREEMPTED


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local(command: list[str], nproc: int, beats: pathlib.Path) -> list[subprocess.Popen]:
    """`nproc` processes on this machine, joined through a coordinator on a free local port; their
    output reaches the launcher's through a `Relay`."""
    port = _free_port()
    return [
        subprocess.Popen(
            command,
            env={**os.environ, heartbeat.ENV: str(beats), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                 "JAX_NUM_PROCESSES": str(nproc), "JAX_PROCESS_ID": str(i)},  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for i in range(nproc)
    ]


class Relay:
    """Copies local workers' output to the launcher's a whole line at a time (up to a newline, or a
    carriage return: a progress bar's redraw). On a shared pipe, workers writing at once split each
    other's lines: Gloo writes its messages in pieces, and a pipe keeps a write whole only up to
    4 KiB. A partial line goes on once its worker has been quiet for `QUIET` seconds (a progress
    bar between redraws), or once it is longer than `LONGEST` bytes, so that what the relay holds
    stays small; another worker's output then starts on a line of its own.
    The copy ends when every worker has closed its output."""

    QUIET = 0.1
    LONGEST = 1 << 20

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        pipes = {p.stdout: sys.stdout.buffer for p in procs} | {p.stderr: sys.stderr.buffer for p in procs}
        self._to = {pipe.fileno(): out for pipe, out in pipes.items()}
        self._pending = dict.fromkeys(self._to, b"")
        self._heard = dict.fromkeys(self._to, 0.0)
        self._open: dict = {}  # a destination -> the pipe whose partial line it got last, if any
        self._thread = threading.Thread(target=self._copy, args=(list(pipes),), daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join(timeout=10)  # a worker's child that left the group could hold a pipe open

    def _copy(self, pipes: list) -> None:
        with selectors.DefaultSelector() as selector:
            for pipe in pipes:
                selector.register(pipe, selectors.EVENT_READ)
            while selector.get_map():
                for key, _ in selector.select(timeout=self.QUIET):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                    self._pending[key.fd] += chunk
                    self._heard[key.fd] = time.monotonic()
                    self._send(key.fd, whole_lines_only=bool(chunk))
                for fd, data in self._pending.items():
                    if data and time.monotonic() - self._heard[fd] >= self.QUIET:
                        self._send(fd, whole_lines_only=False)

    def _send(self, fd: int, whole_lines_only: bool) -> None:
        data = self._pending[fd]
        whole = whole_lines_only and len(data) < self.LONGEST
        end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1 if whole else len(data)
        if not end:
            return
        sent, self._pending[fd], out = data[:end], data[end:], self._to[fd]
        if self._open.get(out) not in (None, fd):
            sent = b"\n" + sent  # another worker's partial line ends there
        self._open[out] = None if sent.endswith(b"\n") else fd
        try:
            out.write(sent)
            out.flush()
        except OSError:  # the launcher's own output is gone: the workers go on unheard
            pass


def start_slurm(command: list[str], beats: pathlib.Path) -> list[subprocess.Popen]:
    """One job step of every task in this allocation; a task that fails ends the step."""
    return [
        subprocess.Popen(
            ["srun", "--kill-on-bad-exit=1", *command], env={**os.environ, heartbeat.ENV: str(beats)},
            start_new_session=True,
        )
    ]  # fmt: skip


def _end_slurm_steps() -> None:
    """SIGKILL to this job's running steps (the batch script's aside): when srun dies, SLURM ends its
    step, except one whose stopped task keeps its step daemon waiting for the srun that is gone."""
    steps = subprocess.run(["squeue", "--steps", f"--jobs={os.environ['SLURM_JOB_ID']}", "--noheader", "--format=%i"],
                           capture_output=True, text=True).stdout.split()  # fmt: skip
    if numbered := [s for s in steps if s.rpartition(".")[2].isdigit()]:
        subprocess.run(["scancel", "--signal=KILL", *numbered], capture_output=True)


def _stop(procs: list[subprocess.Popen], slurm: bool) -> None:
    running = [p for p in procs if p.poll() is None]
    if slurm and running:
        _end_slurm_steps()
    for p in running:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # also reaches a stopped (hung) worker and its children
    for p in procs:
        p.wait()


class _Shutdown:
    """SIGTERM or SIGINT to the launcher: the workers are to save and stop."""

    requested = False

    @classmethod
    def install(cls) -> None:
        def request(signum, frame):
            log.info(f"launch: {signal.Signals(signum).name} received; the workers save and stop")
            cls.requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request)


def run_group(
    procs: list[subprocess.Popen], nproc: int, beats: pathlib.Path, heartbeat_timeout: float, startup_timeout: float,
    slurm: bool,
) -> str:  # fmt: skip
    """Watches one attempt (`procs`: the local processes, or the one srun of a SLURM step); returns
    FINISHED, PREEMPTED, or why it failed. Locally, a shutdown request is passed on as SIGTERM; under
    SLURM it is not: SLURM signals every task of a job step itself, and srun would answer a SIGTERM
    by killing them."""
    started, forwarded = time.time(), False
    try:
        while True:
            codes = [p.poll() for p in procs]
            if _Shutdown.requested:
                if not slurm and not forwarded:
                    for p in procs:
                        if p.poll() is None:
                            os.killpg(p.pid, signal.SIGTERM)
                    forwarded = True
                if all(c is not None for c in codes):
                    return PREEMPTED
            elif all(c == 0 for c in codes):
                said = {heartbeat.outcome(beats, i) for i in range(nproc)}
                return PREEMPTED if PREEMPTED in said else FINISHED
            elif failed := [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]:
                i, code = failed[0]
                return f"{'srun' if slurm else f'process {i}'} exited with code {code}"
            for i in range(nproc):
                if heartbeat.outcome(beats, i) is not None or (not slurm and codes[i] is not None):
                    continue  # stopping or stopped: no more beats to come
                why = heartbeat.overdue(beats, i, started, heartbeat_timeout, startup_timeout)
                if why and not _Shutdown.requested:
                    return f"process {i} {why}: hung"
            time.sleep(0.5)
    finally:
        _stop(procs, slurm)


def main() -> None:
    parser = cli.parser("python -m jaxllm.launch", __doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--nproc", type=int, help="processes to start on this machine")
    where.add_argument("--slurm", action="store_true", help="run every task of this SLURM allocation with srun")
    parser.add_argument("--heartbeat-dir", help="where processes write their heartbeats; under SLURM on storage "
                        "every node shares (default: a temporary directory, fine for --nproc)")  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=300.0, help="seconds without a step")
    parser.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds until the first step, and "
                        "for each evaluation and the end of training (the last save and the sample)")
    parser.add_argument("--backoff", type=float, default=5.0, help="seconds before the first restart, doubling")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    cli.add_logging(parser)
    args = parser.parse_args()
    cli.parse_logging(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the training command after --")
    if args.slurm and "SLURM_NTASKS" not in os.environ:
        parser.error("--slurm runs inside a SLURM allocation (sbatch or salloc), and SLURM_NTASKS is not set here")
    if args.slurm and not args.heartbeat_dir:
        parser.error("--slurm needs --heartbeat-dir on storage that every node of the job shares")
    nproc = int(os.environ["SLURM_NTASKS"]) if args.slurm else args.nproc
    with tempfile.TemporaryDirectory(prefix="jaxllm-heartbeat-") as scratch:
        beats = pathlib.Path(args.heartbeat_dir or scratch)
        sys.exit(supervise(command, nproc, beats, args))


def supervise(command: list[str], nproc: int, beats: pathlib.Path, args: argparse.Namespace) -> int | str:
    """Runs attempts until one finishes, the job is asked to stop, or the restarts run out."""
    backoff = args.backoff
    _Shutdown.install()
    for attempt in range(args.max_restarts + 1):
        if _Shutdown.requested:  # during the backoff
            return PREEMPTED_EXIT
        beats.mkdir(parents=True, exist_ok=True)
        for old in beats.iterdir():  # an earlier attempt's beats and outcomes say nothing of this one
            old.unlink()
        procs = start_slurm(command, beats) if args.slurm else start_local(command, nproc, beats)
        relay = None if args.slurm else Relay(procs)
        result = run_group(procs, nproc, beats, args.heartbeat_timeout, args.startup_timeout, args.slurm)
        if relay:
            relay.join()  # the workers' last words come before the launcher's
        if result == FINISHED:
            log.info(f"launch: all {nproc} processes finished")
            return 0
        if result == PREEMPTED or _Shutdown.requested:
            log.info("launch: stopped on request after saving; run it again (SLURM: requeue) to resume")
            return PREEMPTED_EXIT
        log.warning(f"launch: attempt {attempt + 1} failed: {result}")
        if attempt < args.max_restarts:
            log.info(f"launch: restarting the group in {backoff:.0f} s, from the last checkpoint")
            time.sleep(backoff)
            backoff = min(2 * backoff, 300.0)
    return f"launch: giving up after {args.max_restarts} restarts; the last attempt failed: {result}"


if __name__ == "__main__":
    main()
