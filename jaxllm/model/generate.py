"""KV-cached generation for one sequence: the sample printed after training. The prompt fills
the cache in one pass, then each token is one step over the cache; `sampling.sample` draws
(greedy at temperature 0). One compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.model.cache import KVCache
from jaxllm.model.decoder import Model
from jaxllm.model.sampling import Sampling, sample


def generate(
    params: dict,
    model: Model,
    prompt: list[int],
    length: int,
    sampling: Sampling | None = None,
    vocab_size: int | None = None,
) -> list[int]:
    """Continues `prompt` up to `length` tokens in total (prompt included), with one slot's
    `sampling` (greedy by default), never drawing an id ≥ `vocab_size` (the tokenizer's;
    default the model's)."""
    if not 0 < len(prompt) < length:
        raise ValueError(f"prompt of {len(prompt)} tokens must be non-empty and shorter than length={length}")
    sampling = Sampling.one() if sampling is None else sampling
    vocab_size, config = vocab_size or model.config.vocab_size, model.config
    start = len(prompt)

    def draw(logits, index):
        return sample(logits[:, -1], sampling, jnp.array([index]), vocab_size)

    @jax.jit
    def run(params, prompt):
        logits, cache = model.prefill(params, prompt[None], KVCache.empty(config, 1, length))

        def step(i, carry):
            tokens, token, cache = carry
            tokens = tokens.at[i].set(token[0])
            logits, cache = model.decode_step(params, token[:, None], jnp.full((1, 1), i), cache)
            return tokens, draw(logits, i + 1 - start), cache

        tokens = jnp.zeros(length, jnp.int32).at[:start].set(prompt)
        tokens, last, _ = jax.lax.fori_loop(start, length - 1, step, (tokens, draw(logits, 0), cache))
        return tokens.at[length - 1].set(last[0])  # the last token needs no step over the cache

    return [int(t) for t in run(params, jnp.asarray(prompt, jnp.int32))]
