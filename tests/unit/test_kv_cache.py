"""KV-cached decoding against full recomputation, on meshes that split the rows over `data` and
the heads over `tensor`; the end-of-training sample decodes with the cache. (The serving engine's
own tests cover its decode step's donation and memory.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from support.runs import small_config

from jaxllm.model import Model
from jaxllm.model.cache import AXES, KVCache
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
