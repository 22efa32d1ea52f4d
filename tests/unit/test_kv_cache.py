"""KV-cached decoding against full recomputation, on meshes that split the rows over `data` and
the heads over `tensor`; the end-of-training sample decodes with the cache; the paged form's
writes and reads against a token-by-token reference. (The serving engine's own tests cover its
decode step's donation and memory.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from support.runs import small_config

from jaxllm.model import Model
from jaxllm.model.cache import AXES, SCRATCH_PAGE, KVCache, read, write
from jaxllm.model.generate import generate
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import logical_spec, tree_shardings
from jaxllm.train.step import init_params

ROWS, STEPS, MAX_LEN = 8, 24, 40
PROMPTS = [3, 10, 5, 8, 1, 12, 7, 4]  # each row's prompt length: rows decode at their own positions
PADDED = 16


def _setup(tensor: int):
    cfg = small_config(num_kv_heads=4)
    cfg = cfg.updated(parallel=dict(data=8 // tensor, tensor=tensor))
    mesh = make_mesh(cfg.parallel)
    params = jax.device_put(init_params(cfg), tree_shardings(Model(cfg.model).specs, mesh))
    return cfg.model, mesh, params


def _cache_sharding(mesh):
    return NamedSharding(mesh, logical_spec(AXES))


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_cached_decoding_equals_full_recompute(tensor):
    """Each row is prefilled alone, the rows are put side by side in one cache, and all decode
    greedily together for 24 steps, each at its own position; at every step each row's logits
    equal a full forward pass over its tokens so far (fp32, 1e-4, the same argmax)."""
    model, mesh, params = _setup(tensor)
    rng = np.random.default_rng(0)
    tokens = [list(rng.integers(0, model.vocab_size, n)) for n in PROMPTS]
    with jax.set_mesh(mesh):
        # The full pass runs over a fixed-size buffer (causal: later entries cannot matter).
        full = jax.jit(lambda p, t, ends: Model(model).logits(p, t)[jnp.arange(ROWS), ends])
        prefill = jax.jit(lambda p, t: Model(model).prefill(p, t, KVCache.empty(model, 1, MAX_LEN)))
        # Prompts padded to one length: what the padding writes past a prompt is never attended
        # to, and each decode step overwrites its own position before it attends.
        rows = [prefill(params, jnp.asarray([t + [0] * (PADDED - len(t))])) for t in tokens]
        pools = (jnp.concatenate(parts, axis=1) for parts in zip(*(c[:2] for _, c in rows), strict=True))
        cache = KVCache(*jax.device_put(tuple(pools), _cache_sharding(mesh)), jnp.arange(ROWS)[:, None])
        last = jnp.stack([logits[0, len(t) - 1] for (logits, _), t in zip(rows, tokens, strict=True)])
        decode = jax.jit(lambda p, t, pos, c: Model(model).decode_step(p, t, pos, c), donate_argnums=3)
        for step in range(STEPS):
            buffer = np.zeros((ROWS, MAX_LEN), np.int32)
            for r, seq in enumerate(tokens):
                buffer[r, : len(seq)] = seq
            want = full(params, jnp.asarray(buffer), jnp.asarray([len(seq) - 1 for seq in tokens]))
            np.testing.assert_allclose(last, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
            np.testing.assert_array_equal(jnp.argmax(last, -1), jnp.argmax(want, -1))
            for seq, token in zip(tokens, np.asarray(jnp.argmax(last, -1)), strict=True):
                seq.append(int(token))
            new = jnp.asarray([[seq[-1]] for seq in tokens])
            positions = jnp.asarray([[len(seq) - 1] for seq in tokens])
            logits, cache = decode(params, new, positions, cache)
            last = logits[:, -1]


def test_the_sample_decodes_with_the_cache_as_greedy_recompute_would():
    cfg = small_config()
    params = init_params(cfg)
    sampled = generate(params, Model(cfg.model), [5, 9, 2], 20)
    full = jax.jit(lambda p, t: Model(cfg.model).logits(p, t)[0, :, : cfg.model.vocab_size])
    seq = [5, 9, 2]
    while len(seq) < 20:
        buffer = jnp.asarray([seq + [0] * (20 - len(seq))])  # causal: the padding cannot matter
        seq.append(int(jnp.argmax(full(params, buffer)[len(seq) - 1])))
    assert sampled == seq


PAGE_SIZE = 4


def _paged_reference(pool, new, layer, table, positions):
    """`cache.write` spelt out token by token: position p of row b goes to page table[b, p // page
    size] at offset p % page size; a padding token (-1) to the scratch page 0."""
    pool = pool.copy()
    for b, row in enumerate(positions):
        for t, p in enumerate(row):
            page = table[b, p // PAGE_SIZE] if p >= 0 else 0
            pool[layer, page, :, p % PAGE_SIZE] = new[b, t]
    return pool


def test_paged_writes_and_reads_cross_page_boundaries_and_pad_into_the_scratch_page():
    """A pool of 2 layers × 8 pages of 4 positions. Row 0 writes positions 2..9 (three pages, two
    boundaries crossed), row 1 positions 3..4 (one boundary) then two padding tokens; its pages are
    scattered through the pool, out of order. Each entry lands where the token-by-token reference
    puts it, nothing else changes but the scratch page, and `read` hands back each row's positions
    in order from the pages its table names."""
    rng = np.random.default_rng(0)
    layers, pages, heads, dim = 2, 8, 2, 3
    pool = rng.standard_normal((layers, pages, heads, PAGE_SIZE, dim)).astype(np.float32)
    table = np.array([[5, 2, 7], [3, 6, 1]], np.int32)
    positions = np.array([[2, 3, 4, 5, 6, 7, 8, 9], [3, 4, -1, -1, -1, -1, -1, -1]], np.int32)
    new = rng.standard_normal((2, 8, heads, dim)).astype(np.float32)
    written = write(jnp.asarray(pool), jnp.asarray(new), jnp.int32(1), jnp.asarray(table), jnp.asarray(positions))
    got = np.asarray(written)
    want = _paged_reference(pool, new, 1, table, positions)
    untouched = [p for p in range(pages) if p != SCRATCH_PAGE]
    np.testing.assert_array_equal(got[:, untouched], want[:, untouched])
    np.testing.assert_array_equal(got[0], pool[0])  # the other layer
    np.testing.assert_array_equal(got[1, 5, :, 2], new[0, 0].reshape(heads, dim))
    np.testing.assert_array_equal(got[1, 2, :, 0], new[0, 2])  # position 4: the first of row 0's second page
    np.testing.assert_array_equal(got[1, 7, :, 1], new[0, 7])  # position 9: row 0's third page
    np.testing.assert_array_equal(got[1, 6, :, 0], new[1, 1])  # row 1's position 4, on its second page
    rows = np.asarray(read(jnp.asarray(got), jnp.int32(1), jnp.asarray(table)))  # [b, heads, 3 pages × 4, dim]
    assert rows.shape == (2, heads, 3 * PAGE_SIZE, dim)
    for b in range(2):
        for p in range(3 * PAGE_SIZE):
            np.testing.assert_array_equal(rows[b, :, p], got[1, table[b, p // PAGE_SIZE], :, p % PAGE_SIZE])
    np.testing.assert_array_equal(rows[0, :, 2:10], new[0].transpose(1, 0, 2))  # row 0's tokens, in order
