"""The serving engine's device side: the model's parameters, the paged KV cache and slot state
on the mesh, and every step compiled when it starts. The host side (`engine`) talks to it through
four calls: `decode` and `prefill` dispatch a batch and return at once, `read` waits for a
dispatched step's tokens, `reset` zeroes the cache after a failed step.

(A prefill writes its rows' first tokens and sampling settings straight into their slots on the
device, so there is no separate "insert" of a prefilled sequence into the decode batch.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.model.cache import AXES, KVCache
from jaxllm.model.decoder import Model
from jaxllm.parallel.distributed import CacheCounts
from jaxllm.parallel.rules import logical_spec
from jaxllm.plan.hardware import accelerator_of
from jaxllm.serve.batches import DecodeBatch, PrefillBatch, decode_batch, prefill_batch
from jaxllm.serve.buckets import Buckets
from jaxllm.serve.generation import Tokens
from jaxllm.serve.settings import Serving
from jaxllm.serve.steps import Slots, decode, prefill


class Pending(NamedTuple):
    """A dispatched step's outputs, still on the device (a pytree, which `jax.block_until_ready` waits for)."""

    tokens: Tokens
    prompt: Tokens | None = None
    recurs: Any = None  # (prompt lookup's decode steps) [rows] whether the next lookup finds a proposal


def copy_bandwidth() -> float:
    """Bytes/s a jitted read of 256 MB streams on the default device."""
    x = jnp.ones(64 << 20, jnp.float32)
    read = jax.jit(lambda x: x.sum())
    jax.block_until_ready(read(x))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(read(x))
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best


Progress = Callable[[int, int], None]  # (steps compiled, steps in all)


def no_progress(done: int, total: int) -> None:
    """A `Progress` that tells no one."""


def _bytes_on_one_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


class Runner:
    """Runs `serving.model` with `params` (in `mesh`'s shardings) over a cache of the shapes in
    `buckets`, and `serving.draft` with `draft_params` beside it if it has one; tokens are drawn
    below `vocab_size`, from masks of `words` int32 words a row. `progress` hears of each step
    compiled."""

    def __init__(
        self,
        params: dict,
        serving: Serving,
        mesh: Mesh,
        buckets: Buckets,
        vocab_size: int,
        words: int,
        progress: Progress = no_progress,
        draft_params: dict | None = None,
    ):
        self.params, self.mesh, self.buckets, self.words = params, mesh, buckets, words
        self.settings = s = serving.settings
        self.model = Model(serving.model)  # built once: every step binds its graph to the params
        self.draft = None if serving.draft is None else Model(serving.draft)
        self.draft_params = draft_params
        self.vocab_size = vocab_size
        with jax.set_mesh(mesh):
            pool = NamedSharding(mesh, logical_spec(AXES))  # an int8 cache's scales too (their head_dim is 1)
            self._shardings = (pool, NamedSharding(mesh, P()))
            self.reset()
            self._compile(progress)
        device = mesh.devices.flat[0]
        # What one device reads in a decode step, for the achieved-bandwidth gauge.
        self.weight_bytes = _bytes_on_one_device((params, draft_params))
        self.kv_bytes_per_token = _bytes_on_one_device((self.pools, self.draft_pools)) / (s.kv_pages * s.page_size)
        known = accelerator_of(device.device_kind)
        self.bandwidth = known.hbm if known else copy_bandwidth()  # bytes/s of one device's memory

    def reset(self) -> None:
        """A zero cache and slot state on the devices."""
        s = self.settings
        pool, replicated = self._shardings

        def pools(model: Model):  # the draft's pool has the target's pages, its own layers and heads
            cache = KVCache.paged(model.config, s.kv_pages, s.page_size, s.kv_dtype)
            return jax.device_put((cache.keys, cache.values), pool)

        self.pools, self.draft_pools = pools(self.model), self.draft and pools(self.draft)
        self.slots_state = jax.device_put(Slots.empty(s.slots, s.kv_pages, s.page_size), replicated)

    def _compile(self, progress: Progress) -> None:
        """Every step the engine will run, compiled now, each with its outputs' shardings fixed and
        the cache and slot state donated: a decode step per (rows, table width) bucket (and, with
        speculative decoding, one verifying serve.draft_tokens drafts a row), a prefill step per
        (rows, chunk length, table width) bucket."""
        b, pool, replicated = self.buckets, *self._shardings
        out, drafted = ((pool, pool), replicated), self.draft and (pool, pool)
        common = dict(model=self.model, vocab_size=self.vocab_size, draft=self.draft)
        donated = (1, 2, 5)  # the caches and the slot state
        ngram = (self.settings.ngram_min, self.settings.ngram_max) if self.settings.speculative == "ngram" else None
        recurs = replicated if ngram else None
        decode_step = jax.jit(partial(decode, ngram=ngram, **common), out_shardings=(*out, replicated, drafted, recurs),
                              donate_argnums=donated)  # fmt: skip
        prefill_step = partial(prefill, logprobs=self.settings.prompt_nll, **common)
        prefill_step = jax.jit(prefill_step, out_shardings=(*out, replicated, replicated, drafted),
                               donate_argnums=donated)  # fmt: skip
        state, slots, page_size = (self.pools, self.slots_state), self.settings.slots, self.settings.page_size
        drafter = (self.draft_params, self.draft_pools)
        drafts = [0, self.settings.draft_tokens] if self.settings.speculative != "off" else [0]
        decodes = [(rows, width, k) for width in b.pages for rows in b.rows for k in drafts]
        prefills = [
            (rows, chunk, width)
            for width in b.pages
            for chunk in b.chunks
            if width * page_size >= chunk
            for rows in b.prefill_rows(chunk)
        ]
        total = len(decodes) + len(prefills)
        with CacheCounts() as programs:
            self.decode_steps, self.prefill_steps = {}, {}  # by (rows, pages, drafts) and (rows, chunk, pages)
            for rows, width, k in decodes:
                batch = decode_batch([], {}, rows, width, slots, self.words, k)
                self.decode_steps[rows, width, k] = decode_step.lower(self.params, *state, batch, *drafter).compile()
                progress(len(self.decode_steps), total)
            for rows, chunk, width in prefills:
                batch = prefill_batch([], rows, chunk, width, slots, self.words)
                compiled = prefill_step.lower(self.params, *state, batch, *drafter).compile()
                self.prefill_steps[rows, chunk, width] = compiled
                progress(len(self.decode_steps) + len(self.prefill_steps), total)
        self.steps_cached = programs.read  # executables read from the persistent compilation cache

    def decode(self, batch: DecodeBatch) -> Pending:
        """Dispatches a compiled decode step (its bucket from the batch's shapes)."""
        step = self.decode_steps[(*batch.table.shape, batch.drafts.shape[1])]
        state = (self.pools, self.slots_state, batch, self.draft_params, self.draft_pools)
        self.pools, self.slots_state, tokens, self.draft_pools, recurs = step(self.params, *state)
        if not batch.logprobs:  # its log-probs are zeros: `read` makes them on the host, not fetches them
            tokens = Tokens(tokens.ids, None, None, None)
        return Pending(tokens, recurs=recurs)

    def prefill(self, batch: PrefillBatch) -> Pending:
        """Dispatches a compiled prefill step (its bucket from the batch's shapes)."""
        step = self.prefill_steps[(*batch.tokens.shape, batch.table.shape[1])]
        state = (self.pools, self.slots_state, batch, self.draft_params, self.draft_pools)
        self.pools, self.slots_state, tokens, prompt, self.draft_pools = step(self.params, *state)
        return Pending(tokens, prompt if self.settings.prompt_nll else None)

    @staticmethod
    def read(pending: Pending) -> tuple[Tokens, Tokens | None, Any]:
        """A step's tokens (and scored prompt tokens, and `recurs`), on the host once the step has run."""
        tokens, prompt, recurs = jax.device_get((pending.tokens, pending.prompt, pending.recurs))
        if tokens.logprobs is None:
            tokens = Tokens.without_logprobs(tokens.ids)
        return tokens, prompt, recurs

    def decode_bytes(self, contexts: list[int]) -> float:
        """Bytes one device reads in a decode step over sequences of `contexts` tokens."""
        return self.weight_bytes + self.kv_bytes_per_token * sum(contexts)
