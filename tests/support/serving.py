"""The HTTP API on an engine built in this process, behind a real uvicorn server on 127.0.0.1 and
with the engine stepping in a thread of its own: for tests that hook into the engine (a slow or
failing step) and still speak HTTP to it as clients do."""

import contextlib
import socket
import threading
import time

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.serve.api import create_app
from jaxllm.serve.chat import ChatTemplate
from jaxllm.serve.guards import DenyList
from jaxllm.serve.metrics import Metrics
from jaxllm.serve.server import Server


@contextlib.contextmanager
def http_server(engine, api_keys=(), deny=(), model_name="m"):
    """Yields the server's base URL and its `Server`; the engine thread's error, if it stopped, is
    in `server.engine.failure`."""
    settings = engine.settings
    server = Server(settings, engine.limits, model_name, engine.tokenizer, ChatTemplate(), DenyList(list(deny)),
                    frozenset(api_keys), Metrics(engine.slots), engine)  # fmt: skip
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
