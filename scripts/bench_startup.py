"""A server's start-up, cold and again: `python -m jaxllm.serve --workdir RUN` started twice over
a fresh compilation cache, each time until /health answers 200. The first start compiles every
step into the cache; the second reads them back. Prints both times, their ratio and what each
server's log says of its steps.

    python scripts/bench_startup.py --workdir runs/tiny [--max-len 4096]
"""

from __future__ import annotations

import argparse
import http.client
import re
import socket
import subprocess
import sys
import tempfile
import time


def _healthy(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False


def start(workdir: str, cache: str, max_len: int) -> tuple[float, str]:
    """Seconds from launch to a healthy server, and the server's log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "jaxllm.serve", "--workdir", workdir, f"--config.serve.port={port}",
               f"--config.serve.max_len={max_len}", f"--config.model.max_seq_len={max_len}",
               f"--config.serve.compile_cache={cache}"]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            while not _healthy(port):
                if server.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"the server exited:\n{log.read()}")
                time.sleep(0.2)
            seconds = time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(30)
        log.seek(0)
        return seconds, log.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="a training run (the Quickstart's: runs/tiny)")
    parser.add_argument("--max-len", type=int, default=4096, help="serve.max_len (and model.max_seq_len)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        (cold, cold_log), (warm, warm_log) = (start(args.workdir, cache, args.max_len) for _ in range(2))
    for name, seconds, log in (("first start", cold, cold_log), ("second start", warm, warm_log)):
        steps = re.search(r"\d+ steps ready in .*", log)
        print(f"{name}: healthy after {seconds:.1f} s ({steps.group(0) if steps else 'no step count in its log'})")
    print(f"second / first: {warm / cold:.2f}")


if __name__ == "__main__":
    main()
