"""A request can fail only itself. Faults are injected from outside the package (a request let past
validation, a prefill, a stream or a device step that raises, steps made slow) into an engine
loaded from a checkpoint; each fault ends the requests it touches with an error naming them, and
the engine serves the others unchanged: through the Python API, and over HTTP on 127.0.0.1 with
the openai client. Deadlines end requests that run too long, no read waits forever, and clients
that leave (during the prefill, mid-stream, or waiting for a whole answer) free their slots."""

import http.client
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from support.serving import http_server, metric_values, wait_for

from jaxllm.serve import generation as generation_module
from jaxllm.serve.generation import Limits, Request, RequestFailed, Unavailable
from jaxllm.serve.load import load_engine

SLOTS, POISON = 4, 299  # a prompt starting with POISON meets the injected fault
SETTINGS = {
    "serve.slots": SLOTS,
    "model.max_seq_len": 256,
    "serve.max_len": 256,
    "serve.max_prompt_tokens": 32,
    "serve.max_queue": 8,
}


@pytest.fixture(scope="module")
def engine(trained):
    return load_engine(trained[0], SETTINGS)


def _greedy(prompt, max_tokens=12, **kwargs):
    return Request(prompt, max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def _run(engine, generations):
    while engine.busy():
        engine.step()
    return generations


def _poison_prefill(engine, monkeypatch, delay: float = 0.0):
    """Preparing a prefill raises for prompts that start with POISON (after `delay` seconds for
    all prompts, if given)."""
    real = engine._prefill_row

    def prefill_row(chunk):
        time.sleep(delay)
        if chunk.sequence.prompt[0] == POISON:
            raise RuntimeError("prefill broke")
        return real(chunk)

    monkeypatch.setattr(engine, "_prefill_row", prefill_row)


def _slow_steps(engine, monkeypatch, seconds: float):
    real = engine.device.decode

    def decode(batch):
        time.sleep(seconds)
        return real(batch)

    monkeypatch.setattr(engine.device, "decode", decode)


def _idle(engine):
    return not engine.busy() and engine.stats().active_slots == 0


def test_whatever_serving_a_request_raises_ends_it_alone(engine, monkeypatch, caplog):
    """Four poisoned requests, each failing at another stage (its sampling settings, let past
    validation; its prefill; its stream at its first token; another's stream mid-decode, one of
    its two choices) among two healthy ones: each poisoned one ends with an error naming it,
    logged with its traceback; the healthy ones give what they give alone; every slot is free."""
    healthy = [_greedy([3, 4, 5], 20), Request([9, 8], 20, temperature=0.8, seed=3, ignore_eos=True)]
    alone = [_run(engine, [engine.submit(r)])[0].choices()[0].tokens for r in healthy]

    with monkeypatch.context() as m:  # the server's top_k of 2**40, which once stopped the engine
        m.setattr(Limits, "check", lambda self, request: None)
        bad_sampling = engine.submit(Request([5, 6], 8, temperature=0.7, top_k=1 << 40))
    _poison_prefill(engine, monkeypatch)
    bad_prefill = engine.submit(_greedy([POISON, 1]))
    bad_first, bad_later = engine.submit(_greedy([7, 8])), engine.submit(_greedy([7, 9], n=2))

    def break_after(stream, tokens: int):
        push = stream.push

        def broken(token):
            if len(stream.tokens) >= tokens:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return push(token)

        stream.push = broken

    break_after(bad_first.streams[0], 0)
    break_after(bad_later.streams[1], 5)
    fine = [engine.submit(r) for r in healthy]
    _run(engine, [])

    for g, kind in ((bad_sampling, "OverflowError"), (bad_prefill, "RuntimeError"), (bad_first, "UnicodeDecodeError"),
                    (bad_later, "UnicodeDecodeError")):  # fmt: skip
        with pytest.raises(RequestFailed, match=rf"request {g.id} failed in the engine \({kind}\)") as e:
            g.choices(timeout=0)
        assert e.value.code == "internal_error"
        assert f"request {g.id} failed in the engine; the engine serves on" in caplog.text
    assert caplog.text.count("Traceback") >= 4
    assert [g.choices()[0].tokens for g in fine] == alone
    assert engine.failure is None and _idle(engine)
    every_slot = _run(engine, [engine.submit(_greedy([3, 4, 5], 20, n=SLOTS))])[0].choices()
    assert [c.tokens for c in every_slot] == [alone[0]] * SLOTS


def test_failed_decode_steps_restart_the_engine_until_too_many_fail_in_a_row(trained, monkeypatch):
    """A failed device step (decode or prefill) ends the running requests, which lost their
    cache, and the engine rebuilds it: the request that waited is then served as it is alone. More
    failed steps in a row than serve.max_engine_restarts stop the engine: every request ends
    with the error, new ones are refused, and over HTTP /health is 503."""
    engine = load_engine(trained[0], {**SETTINGS, "serve.max_engine_restarts": 1})
    waiting_alone = _run(engine, [engine.submit(_greedy([6, 7]))])[0].choices()[0].tokens
    failures = []

    def flaky(real):
        def step(batch):
            if failures:
                raise failures.pop(0)
            return real(batch)

        return step

    for step in ("decode", "prefill"):
        monkeypatch.setattr(engine.device, step, flaky(getattr(engine.device, step)))
    running = [engine.submit(_greedy([5], 30)) for _ in range(SLOTS)]
    waiting = engine.submit(_greedy([6, 7]))
    engine.step()  # all four prefilled, one waiting
    failures.append(RuntimeError("device hiccup"))
    engine.step()
    for g in running:
        with pytest.raises(RequestFailed, match=rf"request {g.id} was lost when a device step failed \(RuntimeError"):
            g.choices(timeout=0)
    assert engine.restarts == 1 and engine.failure is None
    _run(engine, [])
    assert waiting.choices()[0].tokens == waiting_alone

    running, waiting = engine.submit(_greedy([5], 30, n=SLOTS)), engine.submit(_greedy([6]))
    failures += [RuntimeError("device lost")] * 2
    engine.step()  # the first choice's prefill fails
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()  # one restart allowed, then the second failure in a row (the waiting one's) stops the engine
    assert isinstance(running.error, RequestFailed)
    with pytest.raises(Unavailable, match="the engine has stopped: RuntimeError.'device lost'"):
        waiting.choices(timeout=0)
    with pytest.raises(Unavailable, match="the engine has stopped"):
        engine.submit(Request([5], 2))
    assert _idle(engine)
    with http_server(engine) as (url, _):
        health = httpx.get(f"{url}/health")
        refused = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": [5]})
    assert (health.status_code, health.json()["status"]) == (503, "stopped")
    assert refused.status_code == 503 and "restart the server" in refused.json()["error"]["message"]


def test_requests_past_their_deadline_end_with_an_error_and_free_their_slots(engine, monkeypatch):
    """With slow steps, running and queued requests outlive serve.request_timeout_s: each ends
    with a timeout naming the setting, long before its tokens were done, and the slots are free."""
    monkeypatch.setattr(engine, "settings", engine.settings.replace(request_timeout_s=0.5))
    _slow_steps(engine, monkeypatch, 0.02)
    running = engine.submit(_greedy([5, 6], 200, n=SLOTS))  # 200 steps: at least 4 s
    queued = engine.submit(_greedy([7]))
    _run(engine, [])
    for g in (running, queued):
        with pytest.raises(RequestFailed, match=rf"request {g.id} ran past its deadline of 0.5 s") as e:
            g.choices(timeout=0)
        assert e.value.code == "timeout"
    assert max(len(s.tokens) for s in running.streams) < 100 and not queued.streams[0].tokens
    assert _idle(engine)


def test_no_read_of_a_generation_waits_past_its_deadline(engine, monkeypatch):
    """With no engine stepping at all, reading a request (whole, or its deltas) gives up a grace
    period after its deadline."""
    monkeypatch.setattr(engine, "settings", engine.settings.replace(request_timeout_s=0.2))
    monkeypatch.setattr(generation_module, "READ_GRACE_S", 0.2)
    generation = engine.submit(_greedy([5]))
    with pytest.raises(TimeoutError, match=f"request {generation.id} has not finished"):
        generation.choices()
    with pytest.raises(TimeoutError, match="got no answer from the engine by its deadline"):
        list(generation)
    generation.cancel()
    _run(engine, [])
    assert _idle(engine)


def test_over_http_a_failing_request_is_a_500_naming_it_and_the_others_are_served(engine, monkeypatch, caplog):
    """A request whose prefill raises answers 500 with OpenAI's error body naming its request id,
    and one whose stream breaks mid-way ends its stream with such an error (the openai client
    raises it); both are logged with their tracebacks and counted; concurrent requests give what
    they give alone, and the server stays healthy."""
    _poison_prefill(engine, monkeypatch)
    real_push = generation_module.Generation._push

    def push(self, choice, token, logprob):
        if self.request.prompt[0] == POISON - 1 and len(self.streams[choice].tokens) >= 3:
            raise ValueError("a stop string broke")
        return real_push(self, choice, token, logprob)

    monkeypatch.setattr(generation_module.Generation, "_push", push)
    with http_server(engine) as (url, server):
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        healthy = dict(model="m", prompt=[3, 4, 5], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        alone = sdk.completions.create(**healthy).choices[0].text
        before = metric_values(httpx.get(f"{url}/metrics").text)
        results = {}

        def send(name, call):
            try:
                results[name] = call()
            except Exception as e:  # noqa: BLE001 -- each outcome is checked below
                results[name] = e

        calls = {
            "whole": lambda: sdk.completions.create(**healthy).choices[0].text,
            "streamed": lambda: "".join(c.choices[0].text for c in sdk.completions.create(**healthy, stream=True)),
            "bad prefill": lambda: httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": [POISON, 1]}),
            "bad stream": lambda: list(sdk.completions.create(model="m", prompt=[POISON - 1], max_tokens=20,
                                                               stream=True, extra_body={"ignore_eos": True})),
        }  # fmt: skip
        threads = [threading.Thread(target=send, args=item) for item in calls.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        after = metric_values(httpx.get(f"{url}/metrics").text)
        health = httpx.get(f"{url}/health").status_code

    assert results["whole"] == alone and results["streamed"] == alone
    refused = results["bad prefill"]
    request_id = refused.headers["X-Request-Id"]
    assert refused.status_code == 500 and refused.json()["error"]["code"] == "internal_error"
    assert f"request {request_id} failed in the engine (RuntimeError)" in refused.json()["error"]["message"]
    assert isinstance(results["bad stream"], openai.APIError)
    assert "failed in the engine (ValueError)" in str(results["bad stream"])
    assert caplog.text.count("failed in the engine; the engine serves on") == 2
    counted = [
        after.get(k, 0) - before.get(k, 0)
        for k in ("jaxllm_requests_total[/v1/completions][500]", "jaxllm_request_failures_total[internal_error]")
    ]
    assert counted == [1, 2] and health == 200 and engine.failure is None


def test_over_http_a_request_past_its_deadline_is_a_504_or_an_error_event(engine, monkeypatch):
    monkeypatch.setattr(engine, "settings", engine.settings.replace(request_timeout_s=0.5))
    _slow_steps(engine, monkeypatch, 0.02)
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 200, "ignore_eos": True}
    with http_server(engine) as (url, _):
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        failures = metric_values(httpx.get(f"{url}/metrics").text)["jaxllm_request_failures_total[timeout]"]
    assert whole.status_code == 504 and whole.json()["error"]["code"] == "timeout"
    assert "ran past its deadline of 0.5 s (serve.request_timeout_s)" in whole.json()["error"]["message"]
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "timeout" and len(events) > 3
    assert failures == 2 and _idle(engine)


def test_a_body_that_comes_too_slowly_is_a_408(engine, monkeypatch):
    monkeypatch.setattr(engine, "settings", engine.settings.replace(body_timeout_s=0.5))
    with http_server(engine) as (url, _):
        connection = _connect(url)
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", "100")
        connection.endheaders(b'{"model": ')  # and the rest never comes
        response = connection.getresponse()
        body = json.loads(response.read())
    assert response.status == 408 and "serve.body_timeout_s" in body["error"]["message"]


def _connect(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


def _chat(max_tokens: int, stream: bool) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Write a parser."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip


def _leave_after(url: str, body: dict, seconds: float, read_events: int = 0) -> None:
    """Sends `body`, reads `read_events` lines of its stream (if any), and closes the connection
    `seconds` after sending."""
    connection = _connect(url)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    if read_events:
        response = connection.getresponse()
        for _ in range(read_events):
            response.fp.readline()
    time.sleep(seconds)
    connection.sock.shutdown(2)
    connection.close()


def test_chats_that_take_seconds_answer_and_clients_that_leave_free_their_slots(engine, monkeypatch):
    """With 20 ms per decode step, a 150-token chat takes seconds: whole, it answers 200 with the
    same text as streamed. A client that leaves mid-way (waiting for a whole answer, mid-stream,
    or during a slow prefill) frees its slot within a few steps, and is counted as a 499."""
    _slow_steps(engine, monkeypatch, 0.02)
    with http_server(engine) as (url, _):

        def counters() -> tuple[float, float]:
            """(slot-steps decoded, chat requests answered)."""
            m = metric_values(httpx.get(f"{url}/metrics").text)
            chats = sum(v for k, v in m.items() if k.startswith("jaxllm_requests_total[/v1/chat/completions]"))
            return m["jaxllm_decode_step_slots_sum"], chats

        before, start = counters(), time.perf_counter()
        whole = httpx.post(f"{url}/v1/chat/completions", json=_chat(150, False), timeout=120)
        took = time.perf_counter() - start
        assert whole.status_code == 200, whole.text
        assert took > 2  # the case that failed: a whole chat longer than the server's 0.25 s disconnect poll
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=_chat(150, True), timeout=120) as streamed:
            chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole.json()["choices"][0][
            "message"]["content"]  # fmt: skip
        # Each answer's 149 decode steps (its first token came from the prefill), one slot each.
        assert np.subtract(counters(), before).tolist() == [2 * 149, 2]

        def leaves(body, seconds, read_events=0, prefill_delay=0.0):
            """The slot-steps decoded for a client that leaves after `seconds`."""
            if prefill_delay:
                _poison_prefill(engine, monkeypatch, prefill_delay)
            steps, chats = counters()
            _leave_after(url, body, seconds, read_events)
            wait_for(lambda: counters()[1] == chats + 1 and _idle(engine), 30)
            return counters()[0] - steps

        # Left after 1 s of a 200-step answer: about 50 steps, each of one slot.
        assert leaves(_chat(200, False), 1.0) < 120
        assert leaves(_chat(200, True), 1.0, read_events=3) < 120
        assert leaves(_chat(200, True), 0.3, prefill_delay=1.0) < 30  # gone before its prefill ended
        counted = metric_values(httpx.get(f"{url}/metrics").text)
    assert counted["jaxllm_requests_total[/v1/chat/completions][499]"] >= 2
    assert counted["jaxllm_active_slots"] == 0 and counted["jaxllm_queue_depth"] == 0
