"""A bounded soak of `python -m jaxllm.serve`: many concurrent clients for a set time, mixing whole
and streamed completions and chats, `n` > 1, stop strings, log-probs, malformed requests and
clients that leave at random moments. Then it checks, and prints beside its figures:

- no 5xx and no hang (every request answered within --client-timeout), no error inside a stream;
- every slot and queue place free (`jaxllm_active_slots` and `jaxllm_queue_depth` 0);
- the server's `jaxllm_requests_total` adds up to the requests sent, status by status (a client
  that left is the server's 499, or a 200 whose stream it stopped reading);
- the server's resident memory grew by less than 10 % from the end of the first minute (the
  first third of a shorter soak) to the end;
- a greedy completion gives the same text after the soak as before, and /health is 200.

Exit status 1 if any check fails.

    python scripts/soak_serve.py [--workdir runs/tiny] [--clients 64] [--seconds 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

KEY = "soak-key"
MODEL = "soak"
ROUTES = ("/v1/completions", "/v1/chat/completions")
COUNTED = tuple(f"jaxllm_requests_total[{route}]" for route in ROUTES)
PROMPTS = ["def read_config(path):\n", "import json\n", "class Parser:\n    def ", "    return self.", "# Copyright",
           "from email import ", "def main():\n    ", "    if not line:\n"]  # fmt: skip
MALFORMED = [
    (b'{"model": "soak", "prompt":', {}), (b'{"model": "soak", "prompt": "x", "temperature": NaN}', {}),
    (json.dumps({"model": "soak", "prompt": "x", "top_k": 1 << 40}).encode(), {}),
    (json.dumps({"model": "soak", "prompt": "x", "n": 1 << 70}).encode(), {}),
    (b'{"model": "soak", "prompt": "a\\ud800"}', {}), (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), {}),
    (json.dumps({"model": "soak", "prompt": [7] * 5000}).encode(), {}),
    (json.dumps({"model": "soak", "prompt": "x", "logit_bias": {"1": 2}}).encode(), {}),
    (json.dumps({"model": "soak", "prompt": "x"}).encode(), {"Authorization": "Bearer wrong"}),
    (b"[" * 50000 + b"]" * 50000, {}),
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/tiny", help="a training run to serve (the Quickstart's by default)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--client-timeout", type=float, default=120.0, help="a request unanswered this long is a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures here")
    return p.parse_args()


def start_server(workdir: str, clients: int, log) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = {"port": port, "model_name": MODEL, "slots": 8, "max_len": 256, "max_prompt_tokens": 128,
                "max_queue": 4 * clients, "rate_per_s": 1e6, "burst": 10**6}  # fmt: skip
    command = [sys.executable, "-m", "jaxllm.serve", "--workdir", workdir,
               *(f"--config.serve.{k}={v}" for k, v in settings.items())]  # fmt: skip
    env = {**os.environ, "JAXLLM_API_KEYS": KEY}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), port


def metric_values(text: str) -> dict[str, float]:
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return {s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value for s in samples}


class Soak:
    def __init__(self, base: str, args: argparse.Namespace):
        self.base, self.args = base, args
        self.results: list[tuple[str, str, float]] = []  # (kind, outcome: a status, "gone" or "hang", seconds)
        self.stream_errors: list[str] = []

    def valid_body(self, rng: random.Random, chat: bool, stream: bool, max_tokens: int | None = None) -> dict:
        body = {"model": MODEL, "max_tokens": max_tokens or rng.randint(1, 48), "n": rng.choice([1, 1, 2, 3]),
                "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 32), "stream": stream}  # fmt: skip
        if rng.random() < 0.3:
            body["stop"] = rng.choice([["\n\n"], ["def", "return"], "self"])
        if chat:
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
            if rng.random() < 0.3:
                body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        else:
            body["prompt"] = rng.choice(PROMPTS) if rng.random() < 0.8 else rng.sample(PROMPTS, 2)
            if rng.random() < 0.3:
                body["logprobs"] = rng.randint(0, 5)
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body

    async def send(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        kind = rng.choices(["whole", "stream", "malformed", "leave"], [4, 4, 2, 2])[0]
        chat = rng.random() < 0.5
        path = ROUTES[chat]
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.args.client_timeout):
                if kind == "malformed":
                    content, headers = rng.choice(MALFORMED)
                    outcome = str((await client.post(ROUTES[0], content=content, headers=headers)).status_code)
                elif kind == "leave":
                    outcome = await self.leave(client, path, rng, chat)
                else:
                    outcome = await self.valid(client, path, self.valid_body(rng, chat, kind == "stream"))
        except TimeoutError:
            outcome = "hang"
        self.results.append((f"{kind} {'chat' if chat else 'completion'}", outcome, time.monotonic() - start))

    async def valid(self, client: httpx.AsyncClient, path: str, body: dict, trace=None) -> str:
        extensions = {} if trace is None else {"trace": trace}
        if not body["stream"]:
            return str((await client.post(path, json=body, extensions=extensions)).status_code)
        async with client.stream("POST", path, json=body, extensions=extensions) as response:
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        if response.status_code == 200 and (events[-1:] != ["[DONE]"] or any('"error"' in e[:10] for e in events)):
            self.stream_errors.append(events[-2] if len(events) > 1 else repr(events))
        return str(response.status_code)

    async def leave(self, client: httpx.AsyncClient, path: str, rng: random.Random, chat: bool) -> str:
        """A request whose client leaves at a random moment after sending it."""
        body = self.valid_body(rng, chat, rng.random() < 0.5, max_tokens=120) | {"ignore_eos": True}
        sent = asyncio.Event()

        async def trace(event: str, info: dict) -> None:
            if event == "http11.send_request_body.complete":
                sent.set()

        # A connection of its own: one dropped mid-request is never handed back to a pool.
        async with httpx.AsyncClient(base_url=self.base, headers=client.headers, timeout=None) as own:
            request = asyncio.create_task(self.valid(own, path, body, trace))
            await asyncio.wait([request, asyncio.create_task(sent.wait())], return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait([request], timeout=rng.uniform(0.0, 1.5))
            if request.done():
                return request.result()
            request.cancel()
            await asyncio.wait([request])
        return "gone"

    async def client(self, index: int, end: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        headers = {"Authorization": f"Bearer {KEY}"}
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=self.base, headers=headers, limits=limits, timeout=None) as client:
            while time.monotonic() < end:
                await self.send(client, rng)

    async def run(self, server: psutil.Process) -> list[tuple[float, int]]:
        """Runs the clients; returns the server's resident memory, sampled every second."""
        start = time.monotonic()
        end = start + self.args.seconds
        rss = []

        async def sample():
            while time.monotonic() < end:
                rss.append((time.monotonic() - start, server.memory_info().rss))
                await asyncio.sleep(1.0)

        await asyncio.gather(sample(), *(self.client(i, end) for i in range(self.args.clients)))
        rss.append((time.monotonic() - start, server.memory_info().rss))
        return rss


def greedy(base: str) -> str:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    return response.json()["choices"][0]["text"]


def main() -> int:
    args = parse_args()
    if not pathlib.Path(args.workdir, "checkpoints").is_dir():
        sys.exit(f"error: {args.workdir} holds no training run; train one first (the README's Quickstart)")
    log_path = pathlib.Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    print(f"server log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        process, port = start_server(args.workdir, args.clients, log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"error: the server did not start; see {log_path}")
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        before = greedy(base)
        sent_before = metric_values(httpx.get(f"{base}/metrics").text)
        soak = Soak(base, args)
        rss = asyncio.run(soak.run(psutil.Process(process.pid)))
        settle = time.monotonic() + 30  # until every request is answered and counted, and every slot free
        while time.monotonic() < settle:
            m = metric_values(httpx.get(f"{base}/metrics").text)
            counted = sum(v - sent_before.get(k, 0) for k, v in m.items() if k.startswith(COUNTED))
            if m["jaxllm_active_slots"] == m["jaxllm_queue_depth"] == 0 and counted >= len(soak.results):
                break
            time.sleep(0.2)
        figures = summarize(soak, rss, sent_before, m, args)
        figures["greedy text unchanged"] = greedy(base) == before
        figures["health after"] = httpx.get(f"{base}/health").status_code
    finally:
        process.terminate()
        process.wait(30)
    return report(figures, args)


def summarize(soak: Soak, rss, before: dict, after: dict, args) -> dict:
    outcomes = collections.Counter(outcome for _, outcome, _ in soak.results)
    server = collections.Counter()
    for key, value in after.items():
        route, _, status = key.removeprefix("jaxllm_requests_total[").rstrip("]").partition("][")
        if key.startswith("jaxllm_requests_total[") and route in ROUTES:
            server[status] += value - before.get(key, 0)
    baseline_at = min(60.0, args.seconds / 3)
    baseline = next(r for t, r in rss if t >= baseline_at)
    latencies = sorted(s for _, outcome, s in soak.results if outcome == "200")
    kinds = collections.Counter(kind for kind, _, _ in soak.results)
    answered_ok = outcomes["200"] + outcomes["gone"]  # a client that left: a 200 it stopped reading, or a 499
    return {
        "clients": args.clients, "seconds": args.seconds, "requests": len(soak.results), "by kind": dict(kinds),
        "client outcomes": dict(outcomes), "server statuses": {k: int(v) for k, v in sorted(server.items())},
        "server 5xx": int(sum(v for k, v in server.items() if k.startswith("5"))),
        "hangs": outcomes["hang"], "hung kinds": sorted({k for k, outcome, _ in soak.results if outcome == "hang"}),
        "errors inside streams": len(soak.stream_errors),
        "first stream error": soak.stream_errors[0] if soak.stream_errors else None,
        "counted as sent": int(sum(server.values())) == len(soak.results),
        "statuses match": all(server[s] == outcomes[s] for s in server if s not in ("200", "499"))
        and server["200"] + server["499"] == answered_ok,
        "failures counted": int(sum(v for k, v in after.items() if k.startswith("jaxllm_request_failures_total"))),
        "active slots after": after["jaxllm_active_slots"], "queue depth after": after["jaxllm_queue_depth"],
        "p50 s": round(statistics.median(latencies), 3) if latencies else None,
        "p99 s": round(latencies[int(0.99 * (len(latencies) - 1))], 3) if latencies else None,
        "tokens generated": int(after["jaxllm_generated_tokens_total"] - before["jaxllm_generated_tokens_total"]),
        f"RSS MB at {baseline_at:g} s": round(baseline / 2**20, 1), "RSS MB at end": round(rss[-1][1] / 2**20, 1),
        "RSS growth %": round(100 * (rss[-1][1] / baseline - 1), 2),
    }  # fmt: skip


def report(figures: dict, args) -> int:
    checks = {
        "no 5xx": figures["server 5xx"] == 0 and figures["failures counted"] == 0,
        "no hangs": figures["hangs"] == 0,
        "no errors inside streams": figures["errors inside streams"] == 0,
        "slots and queue free": figures["active slots after"] == 0 and figures["queue depth after"] == 0,
        "counters add up": figures["counted as sent"] and figures["statuses match"],
        "memory grew < 10 %": figures["RSS growth %"] < 10,
        "same greedy text, healthy": figures["greedy text unchanged"] and figures["health after"] == 200,
    }
    figures["checks"] = checks
    width = max(map(len, figures))
    for name, value in figures.items():
        if name != "checks":
            print(f"{name:>{width}}  {value}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
