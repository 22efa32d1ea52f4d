"""Runs N local JAX processes as one job and keeps it going.

    python -m jaxllm.launch --nproc 2 [--max-restarts 3] -- python -m jaxllm.train --config ... --workdir DIR

Each worker gets the coordinator address, its process id and count (`jax.distributed`), gloo
collectives for CPU devices, and a heartbeat file that the training loop touches every step. The
launcher restarts the whole group, with backoff, when any worker exits with an error or makes no
progress for `--heartbeat-timeout` seconds (`--startup-timeout` until its first step, which
includes compilation and data preparation). Training resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

from jaxllm import cli, heartbeat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # also reaches a stopped (hung) worker and its children
    for p in procs:
        p.wait()


class _Shutdown:
    """SIGTERM or SIGINT to the launcher: pass SIGTERM on to the workers (they save and exit), then stop."""

    requested = False

    @classmethod
    def install(cls) -> None:
        def request(signum, frame):
            print(f"launch: {signal.Signals(signum).name} received; asking the workers to save and stop", flush=True)
            cls.requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request)


def run_group(command: list[str], nproc: int, heartbeat_timeout: float, startup_timeout: float) -> str | None:
    """Runs one attempt; returns None on success (or a requested shutdown), else why it failed."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="jaxllm-heartbeat-") as beats:
        procs = []
        for i in range(nproc):
            env = {
                **os.environ,
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": str(nproc),
                "JAX_PROCESS_ID": str(i),
                "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                heartbeat.ENV: str(pathlib.Path(beats) / str(i)),
            }
            procs.append(subprocess.Popen(command, env=env, start_new_session=True))
        started = time.time()
        try:
            while True:
                if _Shutdown.requested:
                    for p in procs:
                        if p.poll() is None:
                            os.killpg(p.pid, signal.SIGTERM)
                    for p in procs:
                        p.wait()
                    return None
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    return None
                for i, code in enumerate(codes):
                    if code not in (None, 0):
                        return f"process {i} exited with code {code}"
                for i in range(nproc):
                    beat = pathlib.Path(beats) / str(i)
                    since, limit = (
                        (time.time() - beat.stat().st_mtime, heartbeat_timeout)
                        if beat.exists()
                        else (time.time() - started, startup_timeout)
                    )
                    if since > limit and codes[i] is None:
                        what = "since its last step" if beat.exists() else "since start (no step yet)"
                        return f"process {i} made no progress for {since:.0f} s {what}: hung"
                time.sleep(0.5)
        finally:
            _stop(procs)


def main() -> None:
    parser = cli.parser("python -m jaxllm.launch", __doc__)
    parser.add_argument("--nproc", type=int, required=True, help="processes to start on this machine")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=300.0, help="seconds without a step")
    parser.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds until the first step")
    parser.add_argument("--backoff", type=float, default=5.0, help="seconds before the first restart, doubling")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the training command after --")
    backoff = args.backoff
    _Shutdown.install()
    for attempt in range(args.max_restarts + 1):
        failure = run_group(command, args.nproc, args.heartbeat_timeout, args.startup_timeout)
        if _Shutdown.requested:
            print("launch: stopped on request; run the same command to resume", flush=True)
            return
        if failure is None:
            print(f"launch: all {args.nproc} processes finished", flush=True)
            return
        print(f"launch: attempt {attempt + 1} failed: {failure}", flush=True)
        if attempt < args.max_restarts:
            print(f"launch: restarting the group in {backoff:.0f} s, from the last checkpoint", flush=True)
            time.sleep(backoff)
            backoff = min(2 * backoff, 300.0)
    sys.exit(f"launch: giving up after {args.max_restarts} restarts")


if __name__ == "__main__":
    main()
