"""The HTTP API on an engine built in this process, behind a real uvicorn server on 127.0.0.1 and
with the engine stepping in a thread of its own: for tests that hook into the engine (a slow or
failing step) and still speak HTTP to it as clients do."""

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.data.chat import ChatTemplate
from jaxllm.serve.api import create_app
from jaxllm.serve.guards import DenyList
from jaxllm.serve.metrics import Metrics
from jaxllm.serve.server import Server
from support.runs import ROOT, device_env


@contextlib.contextmanager
def http_server(engine, api_keys=(), deny=(), model_name="m"):
    """Yields the server's base URL and its `Server`; the engine thread's error, if it stopped, is
    in `server.engine.failure`."""
    settings = engine.settings
    server = Server(settings, engine.limits, model_name, engine.tokenizer, ChatTemplate(), DenyList(list(deny)),
                    frozenset(api_keys), Metrics(engine.slots, model_name), engine)  # fmt: skip
    stop = threading.Event()

    def step_until_stopped():
        with contextlib.suppress(Exception):  # a stopped engine is what some tests look for
            engine.serve_forever(stop, server.metrics.step_slots.observe)

    listening = socket.create_server(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    threads = [threading.Thread(target=step_until_stopped), threading.Thread(target=http.run, args=([listening],))]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: http.started, 30)
        yield f"http://127.0.0.1:{listening.getsockname()[1]}", server
    finally:
        http.should_exit = True
        stop.set()
        for thread in threads:
            thread.join(60)


def wait_for(condition, timeout=60.0):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text → {name[label values...]: value}."""
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return {s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value for s in samples}


def _get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@contextlib.contextmanager
def serve_process(source: list, log, *flags):
    """`python -m jaxllm.serve SOURCE FLAGS` (SOURCE: e.g. --workdir RUN) on a free port of
    127.0.0.1, once /health says 200; yields the port and the (status, engine_up, /health's body)
    that /health and /metrics gave while it started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "jaxllm.serve", *map(str, source), f"--config.serve.port={port}", *flags]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=device_env(), stdout=out, stderr=subprocess.STDOUT)
    statuses = []

    def healthy():
        assert process.poll() is None, log.read_text()
        try:
            status, body = _get(port, "/health")
            up = metric_values(_get(port, "/metrics")[1].decode())["jaxllm_engine_up"]
            statuses.append((status, up, json.loads(body)))
        except ConnectionRefusedError:
            return False
        return status == 200

    try:
        wait_for(healthy, timeout=300)
        yield port, statuses
    finally:
        process.terminate()
        process.wait(30)
