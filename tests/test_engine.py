"""The serving engine, loaded from a checkpoint trained with a 2-stage pipeline onto tensor-parallel
meshes of 1, 2 and 4 devices: at each of 24 decode steps every request's log-probs equal a full
recompute on one device; a request generates the same tokens alone as among seven others that join
at staggered steps, greedy and sampled; the decode step updates its donated cache in place. Behind
the HTTP app in-process: the perplexity alarm without refusing."""

import contextlib
import math
import re
import subprocess
import sys
from functools import partial

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import checkpoint_params
from serving import http_server

from jaxllm.model.decoder import Model
from jaxllm.plan import hlo
from jaxllm.serve.generation import Request, RequestError
from jaxllm.serve.load import load_engine
from jaxllm.serve.steps import bucket_for, prefill, prompt_buckets

PPL_ALARM = 300.0  # about the vocabulary's size: the barely trained model passes it on some prompts
SLOTS, NEW = 8, 25  # the first token comes from the prefill, then 24 decode steps
PROMPTS = [3, 10, 5, 16, 1, 12, 7, 4]
JOINS = {0: [3], 1: [0, 5], 4: [1], 5: [7, 2], 9: [6, 4]}  # decode step → requests submitted before it
# Long slots, so the cache outweighs the decode step's fixed temporaries, as it does at scale.
SERVE = {"serve.slots": SLOTS, "model.max_seq_len": 4096, "serve.max_len": 4096, "serve.max_prompt_tokens": 16,
         "serve.dtype": "float32"}  # fmt: skip


@pytest.fixture(scope="module")
def engines(trained):
    """The engine on `tensor` devices, built once per module (each compiles every step)."""
    built = {}

    def get(tensor: int):
        if tensor not in built:
            # The prompts' log-probs on 1 (for the perplexity alarm) and 4 devices; on 2, the
            # prefill that skips them.
            logprobs = {1: {"serve.ppl_alarm": PPL_ALARM}, 2: {}, 4: {"serve.prompt_nll": True}}[tensor]
            built[tensor] = load_engine(trained[0], {**SERVE, "serve.tensor": tensor, **logprobs})
        return built[tensor]

    return get


def _requests(vocab):
    """Greedy and sampled (top-k, top-p) requests of different lengths, each with its own seed."""
    rng = np.random.default_rng(1)
    return [
        Request(
            rng.integers(0, vocab, n).tolist(), NEW, temperature=0.0 if r % 2 else 0.9, top_k=20 * (r % 3),
            top_p=0.9 if r % 4 == 2 else 1.0, seed=100 + r, ignore_eos=True, logprobs=20,
        )
        for r, n in enumerate(PROMPTS)
    ]  # fmt: skip


def _run(engine, requests, joins):
    generations, step = {}, 0
    while step <= max(joins) or engine.busy():
        for r in joins.get(step, []):
            generations[r] = engine.submit(requests[r])
        engine.step()
        step += 1
    return generations


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_engine_matches_full_recompute_and_is_independent_of_neighbours(trained, engines, tensor):
    workdir, model, tokenizer = trained
    engine = engines(tensor)
    assert engine.mesh.shape["tensor"] == tensor and engine.buckets == [16]
    requests = _requests(tokenizer.vocab_size)
    generations = _run(engine, requests, JOINS)
    together = {r: g.choices()[0] for r, g in generations.items()}

    # The reference: every request's whole sequence in one uncached pass on one device.
    params = checkpoint_params(workdir, 2)
    buffer = np.zeros((SLOTS, 48), np.int32)  # causal: what follows a sequence cannot matter
    for r, choice in together.items():
        seq = requests[r].prompt + choice.tokens
        buffer[r, : len(seq)] = seq
    want = np.asarray(
        jax.nn.log_softmax(jax.jit(lambda p, t: Model(model).logits(p, t))(params, buffer)[..., :300], -1)
    )
    for r, choice in together.items():
        assert len(choice.tokens) == NEW and choice.finish_reason == "length"
        start = len(requests[r].prompt) - 1
        for i, logprob in enumerate(choice.logprobs):  # raw model log-probs at each step
            row = want[r, start + i]
            np.testing.assert_allclose(logprob.logprob, row[choice.tokens[i]], rtol=1e-4, atol=1e-4)
            top_ids, top_logprobs = zip(*logprob.top, strict=True)
            np.testing.assert_allclose(top_logprobs, row[list(top_ids)], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(top_logprobs, np.sort(row)[::-1][:20], rtol=1e-4, atol=1e-4)
            if requests[r].temperature == 0:
                assert choice.tokens[i] == int(np.argmax(row)), (r, i)
        assert choice.text == tokenizer.decode(choice.tokens)
        _check_prompt_logprobs(generations[r], want[r], tensor)

    for r in range(SLOTS):
        alone = _run(engine, requests, {0: [r]})[r].choices()[0]
        assert alone.tokens == together[r].tokens, r


@contextlib.contextmanager
def _served_in_process(engine):
    """The HTTP app on `engine`, in this process, with the engine stepping in a thread."""
    with http_server(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        yield http


def _check_prompt_logprobs(generation, want, tensor):
    """Each prompt token's log-prob and top 20 as the server reports them, the perplexity and
    (on 1 device, which has the alarm on but not refusing) the alarm."""
    scored, prompt = generation.prompt_logprobs, generation.request.prompt
    if tensor == 2:
        assert scored is None and generation.perplexity is None
        return
    rows = want[np.arange(len(prompt) - 1)]
    np.testing.assert_allclose(scored.logprobs, rows[np.arange(len(prompt) - 1), prompt[1:]], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(scored.top_logprobs, -np.sort(-rows, axis=-1)[:, :20], rtol=1e-4, atol=1e-4)
    nll = -scored.logprobs
    whole = np.exp(nll.mean()) if len(nll) else 1.0
    np.testing.assert_allclose(generation.perplexity, (whole, whole), rtol=1e-5)  # prompts shorter than a window
    assert generation.alarm == (tensor == 1 and whole > PPL_ALARM)


def test_prompts_over_the_alarm_are_served_counted_and_logged_unless_refused(engines, caplog):
    """On 1 device the alarm is on (serve.ppl_alarm) without serve.ppl_reject: through HTTP,
    every prompt is served, and those whose perplexity (from their echoed log-probs) passes the
    alarm are counted and logged with their request id."""
    rng, alarmed = np.random.default_rng(5), []
    with _served_in_process(engines(1)) as http:
        for length in (4, 8, 12, 16) * 3:
            body = {"model": "m", "prompt": rng.integers(0, 300, length).tolist(), "max_tokens": 2, "echo": True,
                    "logprobs": 0, "temperature": 0}  # fmt: skip
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            scored = response.json()["choices"][0]["logprobs"]["token_logprobs"][1:length]
            if np.exp(-np.mean(scored)) > PPL_ALARM:
                alarmed.append(response.headers["X-Request-Id"])
        metrics = http.get("/metrics").text
    assert 0 < len(alarmed) < 12  # both kinds were sent
    assert f"jaxllm_perplexity_alarms_total {float(len(alarmed))}" in metrics
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("perplexity alarm")]
    assert [line.split()[3].rstrip(",") for line in logged] == alarmed


def test_n_choices_share_one_prefill_and_differ_by_choice(trained, engines):
    engine, tokenizer = engines(1), trained[2]
    prompt = tokenizer.encode('{"key": ')
    both = engine.generate([Request(prompt, 12, temperature=1.0, seed=7, n=3, ignore_eos=True)])[0].choices()
    assert len({tuple(c.tokens) for c in both}) == 3  # each choice draws its own tokens
    for n, choice in enumerate(both):  # ... the same as when asked for alone
        alone = engine.generate([Request(prompt, 12, temperature=1.0, seed=7, n=n + 1, ignore_eos=True)])[0]
        assert alone.choices()[n].tokens == choice.tokens


def test_requests_run_without_compiling(trained, engines):
    """Every step was compiled at start-up: serving prompts of every bucket, sampled, with stops,
    log-probs and n choices compiles nothing."""
    engine, tokenizer = engines(1), trained[2]
    events = []

    def record(event, duration, **_):
        if event.startswith("/jax/core/compile"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        requests = [
            Request(tokenizer.encode("{"), 6, temperature=0.0),
            Request([5] * 16, 6, temperature=0.8, top_k=5, top_p=0.9, seed=3, n=2, stop=("}",), logprobs=3),
        ]
        assert all(g.choices() for g in engine.generate(requests))
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert events == []


def test_echoed_logprobs_need_the_prompt_logprobs(engines):
    """On 2 devices the prefill skips the prompt's log-probs: echo with logprobs is refused,
    naming the setting, before anything is queued."""
    engine = engines(2)
    with _served_in_process(engine) as http:
        body = {"model": "m", "prompt": [5, 6], "echo": True, "logprobs": 1}
        refused = http.post("/v1/completions", json=body)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "echo" and "--config.serve.prompt_nll=true" in refused.text
    assert not engine.busy()


def test_decode_step_updates_the_donated_cache_in_place(engines):
    """The compiled decode step on tensor 2 aliases the cache to its output, needs less than half
    the cache's bytes of temporaries (a copy of it would need all), and gathers no weights: its one
    all-gather is of the vocab-split logits, for sampling."""
    engine = engines(2)
    per_device = 2 * engine.state.cache.keys.addressable_shards[0].data.nbytes
    memory = engine.decode_step.memory_analysis()
    assert memory.alias_size_in_bytes >= per_device
    assert memory.temp_size_in_bytes < per_device / 2, (memory.temp_size_in_bytes, per_device)
    gathers = [
        re.search(r"= (\w+)\[([\d,]+)\]", line).groups()
        for _, line in hlo.ops(engine.decode_step.as_text(), "all-gather")
    ]
    assert [(dtype, math.prod(map(int, dims.split(",")))) for dtype, dims in gathers] == [("f32", SLOTS * 384)]


def test_requests_beyond_the_limits_are_refused_with_the_limit(engines):
    engine = engines(1)
    for request, message in [
        (Request([]), "the prompt is empty"),
        (Request([1] * 17, max_tokens=5), "the prompt has 17 tokens and max_tokens is 5; .* at most 16 tokens"),
        (Request([1] * 16, max_tokens=4081), "max_tokens is 4081; .* at most 4096 tokens of prompt and output"),
        (Request([1], n=9), "n=9 must be between 1 and the 8 slots"),
        (Request([300]), r"prompt token ids must be in \[0, 300\)"),
        (Request([1], top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (Request([1], stop=("a", "b", "c", "d", "e")), "5 stop strings given; at most 4"),
        (Request([1], logprobs=21), "logprobs=21 must be between 0 and 20"),
        (Request([1], top_k=1 << 40), "top_k=1099511627776 must be between 0 .* vocabulary's 300"),
        (Request([1], seed=1 << 32), r"seed=4294967296 must be in \[0, 2\*\*32\)"),
        (Request([1], temperature=math.nan), "temperature=nan must be a number of at least 0"),
    ]:
        with pytest.raises(RequestError, match=message):
            engine.submit(request)
    assert not engine.busy()  # nothing refused was queued


def test_prefill_without_logprobs_runs_the_head_once_with_the_same_result(trained):
    workdir, model, _ = trained
    params, tokens, length = checkpoint_params(workdir, 2), jnp.arange(16, dtype=jnp.int32) + 7, jnp.int32(11)
    step = partial(prefill, model=Model(model), vocab_size=300)
    runs = {nll: jax.jit(partial(step, logprobs=nll)).lower(params, tokens, length).compile() for nll in (0, 1)}
    flops = {nll: run.cost_analysis()["flops"] for nll, run in runs.items()}
    assert flops[1] - flops[0] >= 15 * 2 * model.hidden * 384  # the head on 15 more positions
    without, full = (runs[nll](params, tokens, length) for nll in (0, 1))
    np.testing.assert_allclose(without.logits, full.logits, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), without.cache, full.cache)


def test_serving_imports_nothing_of_training():
    """(optax still loads: flax.nnx imports it for its own TrainState.)"""
    probe = "import sys, jaxllm.serve.__main__; print(sorted(m for m in sys.modules if m.startswith('jaxllm.train')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_prompt_buckets_are_powers_of_two_up_to_the_limit():
    assert prompt_buckets(8192, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert prompt_buckets(100, 2048) == [16, 32, 64, 100]
    assert prompt_buckets(10, 2048) == [10]
    buckets = prompt_buckets(100, 2048)
    assert [bucket_for(n, buckets) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]
    with pytest.raises(ValueError, match="a prompt of 101 tokens does not fit: prompts take 1 to 100 tokens"):
        bucket_for(101, buckets)
