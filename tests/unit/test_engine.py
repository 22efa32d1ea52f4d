"""The serving engine over a paged KV cache, loaded from a checkpoint trained with a 2-stage
pipeline onto tensor-parallel meshes of 1, 2 and 4 devices: sixteen requests of mixed lengths
(some sharing a system prompt, some longer than a prefill chunk) arrive at staggered steps; at
every decode step each one's log-probs equal a full recompute on one device, and each generates
the same tokens alone as among the others, greedy and sampled, with the prefix cache on (tensor
2 and 4) and off (tensor 1), and when pages run out and sequences are preempted. Pages go back to
the pool when requests end or are cancelled; a decode step costs no more for a larger pool, and
its attention, a block of pages at a time, equals attention over the gathered pages and copies
no table of them; nothing compiles while serving; the stop ids a model's generation_config.json
names end requests unshown; the Pallas paged-attention kernel (in its interpreter) equals the
XLA path."""

import collections
import contextlib
import json
import math
import re
import shutil
from functools import partial

import httpx
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from support.runs import checkpoint_params, small_config
from support.serving import http_server, metric_values

from jaxllm.config import ConfigError
from jaxllm.data.tokenizer import get_tokenizer
from jaxllm.model.cache import Int8, KVCache, read
from jaxllm.model.decoder import Model
from jaxllm.model.int8 import symmetric_int8
from jaxllm.model.layers import attend, blockwise_paged_attention, paged_decode_attention
from jaxllm.parallel.mesh import make_mesh
from jaxllm.serve.batches import DecodeBatch
from jaxllm.serve.buckets import Buckets
from jaxllm.serve.generation import Request, RequestError
from jaxllm.serve.load import load_engine
from jaxllm.serve.settings import ServeConfig, serving_config
from jaxllm.serve.steps import Slots, decode

PPL_ALARM = 300.0  # about the vocabulary's size: the barely trained model passes it on some prompts
SLOTS, NEW = 8, 25  # the first token comes from the prefill, then 24 decode steps
SYSTEM = list(range(40, 80))  # a shared 40-token system prompt: two full pages of 16
PROMPTS = [3, 10, 5, 16, 1, 12, 7, 4, 60, 33, 2, 50, 9, 20, 64, 6]
JOINS = {0: [3, 8], 1: [0, 5, 14], 4: [1, 11], 5: [7, 2], 9: [6, 4, 9], 12: [10, 12], 13: [13, 15]}
SERVE = {"serve.slots": SLOTS, "model.max_seq_len": 1024, "serve.max_len": 1024, "serve.max_prompt_tokens": 64,
         "serve.prefill_chunk": 32, "serve.dtype": "float32"}  # fmt: skip


@pytest.fixture(scope="module")
def engines(trained):
    """The engine on `tensor` devices, built once per module (each compiles every step)."""
    built = {}

    def get(tensor: int):
        if tensor not in built:
            # On 1 device the prompts' log-probs (for the perplexity alarm), no prefix cache; on
            # 2, the prefill that skips them; on 4, log-probs for every prompt beside the cache.
            extra = {1: {"serve.ppl_alarm": PPL_ALARM, "serve.prefix_cache": False}, 2: {},
                     4: {"serve.prompt_nll": True}}[tensor]  # fmt: skip
            built[tensor] = load_engine(trained[0], {**SERVE, "serve.tensor": tensor, **extra})
        return built[tensor]

    return get


def _requests(vocab):
    """Greedy and sampled (top-k, top-p) requests of different lengths, each with its own seed;
    every third starts with the system prompt."""
    rng = np.random.default_rng(1)
    return [
        Request(
            ((SYSTEM if r % 3 == 0 else []) + rng.integers(0, vocab, n).tolist())[:64], NEW,
            temperature=0.0 if r % 2 else 0.9, top_k=20 * (r % 3), top_p=0.9 if r % 4 == 2 else 1.0, seed=100 + r,
            ignore_eos=True, logprobs=20,
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


def _full_logprobs(workdir, model, sequences):
    """Every sequence in one uncached pass on one device (causal: what follows one cannot matter)."""
    buffer = np.zeros((len(sequences), 96), np.int32)
    for r, seq in enumerate(sequences):
        buffer[r, : len(seq)] = seq
    logits = jax.jit(lambda p, t: Model(model).logits(p, t))(checkpoint_params(workdir, 2), buffer)
    return np.asarray(jax.nn.log_softmax(logits[..., :300], -1))


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_engine_matches_full_recompute_and_is_independent_of_neighbours(trained, engines, tensor):
    workdir, model, tokenizer = trained
    engine = engines(tensor)
    assert engine.device.mesh.shape["tensor"] == tensor and len(engine.buckets.pages) == 3
    requests = _requests(tokenizer.vocab_size)
    generations = _run(engine, requests, JOINS)
    together = {r: g.choices()[0] for r, g in generations.items()}
    assert engine.pool.in_use() == 0  # every page back in the pool
    hits = engine.scheduler.prefix_hits
    assert (hits > 0) == (tensor == 2), hits  # on 4 each first prefill scores its whole prompt

    want = _full_logprobs(workdir, model, [requests[r].prompt + together[r].tokens for r in range(len(requests))])
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

    for r in range(len(requests)):
        alone = _run(engine, requests, {0: [r]})[r].choices()[0]
        assert alone.tokens == together[r].tokens, r


def test_preempted_sequences_resume_with_the_same_output_and_every_page_returns(trained):
    """A pool of 11 pages for four requests that each grow to 6: the newest are preempted and
    later prefill their prompt and output so far again; every request's tokens equal its tokens
    alone. A cancelled request's pages return at the next step."""
    engine = load_engine(trained[0], {"serve.slots": 4, "model.max_seq_len": 1024, "serve.max_len": 128,
                                      "serve.kv_pages": 12, "serve.dtype": "float32"})  # fmt: skip
    rng = np.random.default_rng(3)
    requests = [Request(rng.integers(0, 300, 30).tolist(), 60, temperature=0.0 if r % 2 else 0.8, seed=r,
                        ignore_eos=True) for r in range(4)]  # fmt: skip
    together = [g.choices()[0].tokens for g in engine.generate(requests)]
    assert engine.scheduler.preemptions > 0 and engine.pool.in_use() == 0
    preempted = engine.scheduler.preemptions
    alone = [engine.generate([r])[0].choices()[0].tokens for r in requests]
    assert engine.scheduler.preemptions == preempted and alone == together

    kept, left = engine.submit(requests[0]), engine.submit(requests[1])
    for _ in range(5):
        engine.step()
    held = engine.pool.in_use()
    assert held == sum(len(s.pages) for s in engine.scheduler.running) >= 4
    left.cancel()
    engine.step()
    assert engine.pool.in_use() < held and left.done
    while engine.busy():
        engine.step()
    assert engine.pool.in_use() == 0 and kept.choices()[0].tokens == together[0]


def _count_prefilled(engine, monkeypatch) -> collections.Counter:
    """How many times the engine's prefill steps compute each position, counted from their
    arguments (rows of the scratch slot are padding)."""
    prefilled, real = collections.Counter(), engine.device.prefill

    def prefill(batch):
        rows = zip(batch.slots.tolist(), batch.starts.tolist(), batch.lengths.tolist(), strict=True)
        for slot, start, length in rows:
            if slot != engine.slots:
                prefilled.update(range(start, start + length))
        return real(batch)

    monkeypatch.setattr(engine.device, "prefill", prefill)
    return prefilled


def test_n_choices_share_the_prompts_pages_and_differ_by_choice(trained, engines, monkeypatch):
    """With the prefix cache, a request's later choices take its first's full prompt pages
    instead of prefilling them again: of a 40-token prompt, the first two pages' 32 positions
    are prefilled once for three choices, the last 8 (a page not yet full) once per choice."""
    engine, tokenizer = engines(2), trained[2]
    prompt = (tokenizer.encode('{"key": "value", "list": [1, 2, 3], "more": {"a": null}}') * 3)[:40]
    hits, prefilled = engine.scheduler.prefix_hits, _count_prefilled(engine, monkeypatch)
    three = engine.generate([Request(prompt, 12, temperature=1.0, seed=7, n=3, ignore_eos=True)])[0].choices()
    assert prefilled == collections.Counter({**dict.fromkeys(range(32), 1), **dict.fromkeys(range(32, 40), 3)})
    assert engine.scheduler.prefix_hits - hits == 2 * (len(prompt) - 1) // 16
    assert len({tuple(c.tokens) for c in three}) == 3  # each choice draws its own tokens
    for n, choice in enumerate(three):  # ... the same as when asked for alone
        alone = engine.generate([Request(prompt, 12, temperature=1.0, seed=7, n=n + 1, ignore_eos=True)])[0]
        assert alone.choices()[n].tokens == choice.tokens


def test_the_prefix_cache_counts_its_pages_over_http(engines):
    """On tensor 2 (prefix cache on): a 50-token prompt's three full pages are missed the first
    time and found the second, and /metrics says so, beside the pool's use."""
    engine = engines(2)
    metric_names = ("jaxllm_prefix_cache_hit_pages", "jaxllm_prefix_cache_miss_pages", "jaxllm_kv_pages_cached")
    body = {"model": "m", "prompt": list(range(100, 150)), "max_tokens": 3, "temperature": 0}
    with _served_in_process(engine) as http:
        seen = [metric_values(http.get("/metrics").text)]
        for _ in range(2):
            assert http.post("/v1/completions", json=body).status_code == 200
            seen.append(metric_values(http.get("/metrics").text))
    hits, misses, cached = ([m[name] for m in seen] for name in metric_names)
    assert np.diff(misses).tolist() == [3, 0] and np.diff(hits).tolist() == [0, 3]
    assert cached[1] >= cached[0] + 3 and seen[-1]["jaxllm_kv_cache_usage"] == 0
    assert 0 < seen[-1]["jaxllm_decode_bandwidth_fraction"] == engine.stats().bandwidth_use < 2


@contextlib.contextmanager
def _compiles():
    """Every compile in this process while open (its tracing, lowering or XLA compile events)."""
    events = []

    def record(event, duration, **_):
        if event.startswith("/jax/core/compile"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(record)


def test_requests_run_without_compiling_in_buckets_of_their_live_size(trained, engines, monkeypatch):
    """Every step was compiled at start-up: serving prompts of every chunk length, long and short,
    alone and batched, sampled, with stops, log-probs and n choices, and one request growing
    through every table width, compiles nothing (the count does see a compile done meanwhile).
    Each decode step runs as many rows as are busy (rounded up to a bucket) over a table only as
    wide as the longest live sequence needs: 256 tokens' worth, then 512 once one passes 256,
    then 1024 past 512; prefill steps batch prompts in every (rows, chunk) bucket."""
    engine, tokenizer = engines(2), trained[2]
    b = engine.buckets
    assert b.pages == [16, 32, 64] and b.rows == [1, 2, 4, 8] and b.chunks == [16, 32]
    decodes, prefills, real_decode, real_prefill = [], [], engine.device.decode, engine.device.prefill

    def decode(batch):
        rows = batch.slots
        decodes.append((len(rows), int((rows != engine.slots).sum()), batch.table.shape[1]))  # padded, busy, width
        return real_decode(batch)

    def prefill(batch):
        prefills.append((*batch.tokens.shape, batch.table.shape[1]))  # rows, chunk, width
        return real_prefill(batch)

    monkeypatch.setattr(engine.device, "decode", decode)
    monkeypatch.setattr(engine.device, "prefill", prefill)
    requests = [
        Request(tokenizer.encode("{"), 6, temperature=0.0),
        Request([5] * 16, 6, temperature=0.8, top_k=5, top_p=0.9, seed=3, n=2, stop=("}",), logprobs=3),
        *(Request([7] * n, 60, temperature=0.0, ignore_eos=True) for n in (17, 33, 64, 3, 9, 40, 2)),
        Request([8] * 64, 460, temperature=0.0, ignore_eos=True),  # to 523 tokens: a table of 1024
    ]
    with _compiles() as compiles:
        assert all(g.choices() for g in [*engine.generate(requests), *engine.generate([Request([9] * 5, 2)])])
        while_serving = list(compiles)
        jax.jit(lambda x: x + 1)(np.arange(3))
    assert while_serving == [] and compiles
    rows, busy, widths = zip(*decodes, strict=True)
    assert sorted(set(widths), key=widths.index) == b.pages  # each width in turn, as the longest grows
    assert list(rows) == [Buckets.fit(n, b.rows) for n in busy] and set(rows) == set(b.rows)
    assert {(r, c) for r, c, _ in prefills} == {(r, c) for c in b.chunks for r in b.prefill_rows(c)}


def _decode_cost(model, pages: int, width: int, rows: int = 8, drafts: int = 0):
    """A decode step's flops and temporaries, compiled for a pool of `pages` and tables of `width`
    (verifying `drafts` tokens a row by prompt lookup)."""
    cache = KVCache.paged(model, pages, 16)
    params = jax.eval_shape(lambda: Model(model).init(0))
    lookup = dict(ngram=(2, 4)) if drafts else {}
    step = jax.jit(partial(decode, model=Model(model), vocab_size=model.vocab_size, **lookup), donate_argnums=(1, 2))
    i32 = partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    words = -(-model.vocab_size // 32)
    batch = DecodeBatch(i32((rows,)), i32((rows,)), i32((rows,)), i32((rows, width)),
                        jax.ShapeDtypeStruct((), jnp.bool_), i32((rows, words)), i32((rows, drafts)),
                        i32((rows,)))  # fmt: skip
    with jax.set_mesh(make_mesh(small_config().parallel, jax.devices()[:1])):
        compiled = step.lower(params, (cache.keys, cache.values), Slots.empty(rows, pages, 16), batch).compile()
    return compiled.cost_analysis()["flops"], compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("drafts", [0, 4])
def test_a_decode_step_copies_no_table_of_pages_and_costs_no_more_for_a_larger_pool(drafts):
    """Its flops and temporaries are the same over a pool of 1k or 32k tokens, a verify step's too
    (whether it verifies or, no row having a draft, runs as a plain step, the pool is updated in
    place), and a plain step's temporaries the same over a table of 16 or 256 pages: attention
    reads a block of pages at a time, never a copy of the table's pages (which at 256 pages of 8
    rows would be 4 MB)."""
    model = small_config().model.replace(max_seq_len=4096)
    small, large = (_decode_cost(model, pages, 16, drafts=drafts) for pages in (65, 2049))  # 1k and 32k tokens
    assert small == large
    if not drafts:
        assert _decode_cost(model, 2049, 256)[1] <= small[1]


def _paged_case(kv_dtype: str, pool_pages: int, width: int, positions: jax.Array):
    """Random pools of 16-token pages (in `kv_dtype`), a table of `width` distinct pages a row,
    grouped-query queries at `positions` [rows, t], and `attend` over the table's pages gathered:
    (q, pools, layer, table, the reference)."""
    rng = np.random.default_rng(0)
    kv, layers, d, heads = 2, 3, 32, 8
    pools = [jnp.asarray(rng.normal(size=(layers, pool_pages, kv, 16, d)), jnp.float32) for _ in range(2)]
    if kv_dtype == "int8":
        pools = [Int8(*symmetric_int8(p, (-1,), keepdims=True)) for p in pools]
    rows, tokens = positions.shape
    table = jnp.asarray(rng.permutation(np.arange(1, pool_pages))[: rows * width].reshape(rows, width), jnp.int32)
    q, layer = jnp.asarray(rng.normal(size=(rows, tokens, heads, d)), jnp.float32), jnp.int32(1)
    causal = jnp.arange(width * 16)[None, None] <= positions[:, :, None]
    want = attend(q, *(read(p, layer, table) for p in pools), causal[:, None], kv_layout="bksd")
    return q, pools, layer, table, want


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("width", [32, 23])
def test_blockwise_paged_attention_equals_attention_over_the_gathered_pages(kv_dtype, tokens, width):
    """Over a table of 32 pages of 16 (two blocks) or 23 (a width blocks do not divide, as
    serve.max_len 360 gives: the last block moved back over pages the first read), rows at
    different lengths (one padding), one new token or five (a verify step's): the same as `attend`
    over every page of the table gathered."""
    positions = jnp.asarray([[5 + i for i in range(tokens)], [300 + i for i in range(tokens)], [-1] * tokens])
    q, pools, layer, table, want = _paged_case(kv_dtype, 120, width, positions)
    got = jax.jit(blockwise_paged_attention)(q, *pools, layer, table, positions)
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5, atol=1e-5)


def test_buckets_double_up_to_the_limits():
    b = Buckets.of(slots=8, max_len=4096, page_size=16, prefill_chunk=512)
    assert b.rows == [1, 2, 4, 8] and b.pages == [16, 32, 64, 128, 256] and b.chunks == [16, 32, 64, 128, 256, 512]
    assert [b.prefill_rows(c)[-1] for c in b.chunks] == [8, 8, 8, 4, 2, 1] and b.prefill_rows(128) == [1, 2, 4]
    assert Buckets.of(slots=6, max_len=100, page_size=16, prefill_chunk=512) == Buckets(
        [1, 2, 4, 6], [7], [16, 32, 64, 100], 100
    )


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("width", [8, 15, 130])
def test_the_pallas_paged_kernel_equals_the_xla_path(kv_dtype, width):
    """At 8 pages of 16 (a multi-block shape the engine compiles), and at 15 and 130 (widths the
    kernel's partitions do not divide, padded), grouped-query heads, rows at different lengths and
    a padding row: in the Pallas interpreter, or as the GPU kernel where there is one."""
    positions = jnp.asarray([[5], [width * 9], [width * 16 - 1], [-1]], jnp.int32)
    q, pools, layer, table, want = _paged_case(kv_dtype, 4 * width + 16, width, positions)
    got = paged_decode_attention(q, *pools, layer, table, positions, interpret=jax.default_backend() != "gpu")
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-5, atol=1e-5)
    assert np.isfinite(got[3]).all()  # a padding row reads no page: its output, dropped, stays finite


def test_the_pallas_kernel_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="serve.attention=pallas .* needs a GPU; .* use serve.attention=xla"):
        serving_config(small_config(), ServeConfig(attention="pallas"), 1, "cpu")
    with pytest.raises(ConfigError, match="cannot hold one request of serve.max_len=64 .* at least 5 pages"):
        serving_config(small_config(), ServeConfig(kv_pages=4), 1, "cpu")


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
    windows = [np.exp(nll[i : i + 32].mean()) for i in range(max(1, len(nll) - 31))] if len(nll) else [1.0]
    np.testing.assert_allclose(generation.perplexity, (whole, max(windows)), rtol=1e-5)
    assert generation.alarm == (tensor == 1 and max(whole, *windows) > PPL_ALARM)


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
    """The compiled decode steps on tensor 2 alias the pool to their output and need less than half
    its bytes of temporaries (a copy of it would need all; the widest reads one layer's worth)."""
    engine = engines(2)
    per_device = 2 * engine.device.pools[0].addressable_shards[0].data.nbytes
    for step in engine.device.decode_steps.values():
        memory = step.memory_analysis()
        assert memory.alias_size_in_bytes >= per_device
        assert memory.temp_size_in_bytes < per_device / 2, (memory.temp_size_in_bytes, per_device)


def test_a_decode_step_fetches_log_probs_only_where_a_row_asked_for_them(engines):
    """A step's log-probs are zeros unless a row asked: the host makes those zeros rather than
    copying them from the device. What is still on the device is a pytree of its arrays, which
    `jax.block_until_ready` (the profiler's) waits for."""
    engine = engines(2)
    real, fetched = engine.device.decode, []

    def decode(batch):
        pending = real(batch)
        assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(pending))
        fetched.append((bool(batch.logprobs), pending.tokens.logprobs is not None))
        return pending

    engine.device.decode = decode
    try:
        prompt = list(range(5, 25))
        bare, scored = (engine.generate([Request(prompt, 8, temperature=0.0, ignore_eos=True, logprobs=n)])[0]
                        .choices()[0] for n in (None, 2))  # fmt: skip
    finally:
        engine.device.decode = real
    assert bare.tokens == scored.tokens and all(logprob.logprob < 0 for logprob in scored.logprobs)
    assert {asked for asked, _ in fetched} == {True, False} and all(asked == got for asked, got in fetched)


def _with_stop_ids(workdir, directory, tokenizer, ids):
    """The run's tokenizer.json as a model's files ship it: beside a generation_config.json that
    names `ids` as stops besides eos (as Llama 3's names <|eot_id|>)."""
    directory.mkdir()
    shutil.copyfile(workdir / "tokenizer" / "tokenizer.json", directory / "tokenizer.json")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_id, *ids]}))
    return get_tokenizer(directory)


def _greedy(engine, prompts, **settings):
    return [g.choices()[0] for g in engine.generate([Request(p, 12, temperature=0.0, **settings) for p in prompts])]


def test_the_models_extra_stop_ids_end_a_request_and_are_not_shown(trained, engines, tmp_path, monkeypatch):
    """generation_config.json names two more stop ids: the token one prompt's greedy
    continuation draws k steps in (in a decode step), and another's first token (drawn by its
    prefill). Each request ends there with 'stop', the id neither in its tokens nor its text, and
    its pages back in the pool; with ignore_eos both run on to max_tokens as before."""
    workdir, _, tokenizer = trained
    engine = engines(1)
    prompts = [tokenizer.encode("def parse(text):\n    "), tokenizer.encode('{"key": [1, 2')]
    free = _greedy(engine, prompts, ignore_eos=True)
    greedy, first = free[0].tokens, free[1].tokens[0]
    # The first token from the second on that neither came before nor is the other stop.
    k = next(k for k in range(1, len(greedy)) if greedy[k] not in greedy[:k] and first not in greedy[: k + 1])
    stops = _with_stop_ids(workdir, tmp_path / "tokenizer", tokenizer, [greedy[k], first])
    assert stops.stop_ids == {tokenizer.eos_id, greedy[k], first} and tokenizer.eos_id not in [*greedy, first]
    monkeypatch.setattr(engine, "tokenizer", stops)  # what each request's stream takes its stop ids from
    ended = [(c.tokens, c.text, c.finish_reason) for c in _greedy(engine, prompts)]
    assert ended == [(greedy[:k], tokenizer.decode(greedy[:k]), "stop"), ([], "", "stop")]
    assert engine.pool.in_use() == 0
    ignored = _greedy(engine, prompts, ignore_eos=True)
    assert [(c.tokens, c.finish_reason) for c in ignored] == [(c.tokens, "length") for c in free]


def test_requests_beyond_the_limits_are_refused_with_the_limit(engines):
    engine = engines(1)
    for request, message in [
        (Request([]), "the prompt is empty"),
        (Request([1] * 65, max_tokens=5), "the prompt has 65 tokens and max_tokens is 5; .* at most 64 tokens"),
        (Request([1] * 16, max_tokens=1009), "max_tokens is 1009; .* at most 1024 tokens of prompt and output"),
        (Request([1], n=9), "n=9 must be between 1 and the 8 slots"),
        (Request([300]), r"prompt token ids must be in \[0, 300\)"),
        (Request([1], top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (Request([1], min_p=1.5), r"min_p=1.5 must be in \[0, 1\]"),
        (Request([1], min_p=math.nan), r"min_p=nan must be in \[0, 1\]"),
        (Request([1], stop=("a", "b", "c", "d", "e")), "5 stop strings given; at most 4"),
        (Request([1], stop=("end", "")), "a stop string is empty: it would end the request before any text"),
        (Request([1], logprobs=21), "logprobs=21 must be between 0 and 20"),
        (Request([1], top_k=1 << 40), "top_k=1099511627776 must be between 0 .* vocabulary's 300"),
        (Request([1], seed=1 << 32), r"seed=4294967296 must be in \[0, 2\*\*32\)"),
        (Request([1], temperature=math.nan), "temperature=nan must be a number of at least 0"),
    ]:
        with pytest.raises(RequestError, match=message):
            engine.submit(request)
    assert not engine.busy()  # nothing refused was queued


def test_a_constrained_request_draws_the_models_best_allowed_token_beside_free_ones(trained, engines):
    """On tensor 2: a greedy request under a regex, batched with free requests, draws at each step
    the token the full recompute ranks highest among those its grammar allows; the free requests
    draw what they draw alone; sampled requests under a JSON schema parse and validate."""
    from jaxllm.serve.constraints import Grammars

    workdir, model, tokenizer = trained
    engine, grammars = engines(2), Grammars(tokenizer)
    digits = grammars.regex("[0-9]{1,3}(, [0-9]{1,3}){3}", "regex")
    prompt = tokenizer.encode('{"list": [1, 2, ')
    free = [Request(prompt, 12, temperature=0.0, ignore_eos=True), Request(SYSTEM, 12, temperature=0.9, seed=4)]
    alone = [g.choices()[0].tokens for g in engine.generate(free)]
    constrained, *together = engine.generate([Request(prompt, 40, temperature=0.0, constraint=digits), *free])
    assert [g.choices()[0].tokens for g in together] == alone
    choice = constrained.choices()[0]
    assert re.fullmatch("[0-9]{1,3}(, [0-9]{1,3}){3}", choice.text) and choice.finish_reason == "stop"
    logprobs = _full_logprobs(workdir, model, [prompt + choice.tokens])[0]
    matcher, row = digits.matcher(), np.empty(-(-tokenizer.vocab_size // 32), np.int32)
    for i, token in enumerate(choice.tokens):
        matcher.fill(row)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: tokenizer.vocab_size])
        assert token == allowed[np.argmax(logprobs[len(prompt) - 1 + i, allowed])], i
        matcher.take(token)
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
              "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["id", "tags"],
              "additionalProperties": False}
    sampled = engine.generate([Request(prompt, 120, temperature=1.0, seed=s, n=2,
                                       constraint=grammars.json_schema(schema, "schema")) for s in range(3)])
    for choice in (c for g in sampled for c in g.choices()):
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)
    assert engine.pool.in_use() == 0
