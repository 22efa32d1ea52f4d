"""Building blocks as pure functions over parameter dicts: norms, RoPE, attention, feed-forward.

A sequence attends to itself causally and never across documents (segment ids) in all three
implementations of `self_attention`: `xla` (`attend`: einsums and an fp32 softmax under an explicit
mask, so keys may come from a cache; runs everywhere), `cudnn` (cuDNN's fused flash attention
through `jax.nn.dot_product_attention`) and `pallas` (JAX's Triton flash-attention kernel). The
fused two run on GPUs; config validation says which shapes each takes.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.gpu.attention import mha
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

from jaxllm.config import RopeScaling
from jaxllm.model.cache import Entries, Int8, encode, read, write
from jaxllm.model.dense import Project, einsum_projections
from jaxllm.model.lora import adapted, with_dropout
from jaxllm.parallel.rules import manual_spec

NEG_INF = -1e30  # finite, so fully masked rows give a uniform softmax instead of NaN


class Context(NamedTuple):
    """Per-sequence inputs every layer needs, computed once per forward pass."""

    rope: tuple[jax.Array, jax.Array]
    segment_ids: jax.Array | None  # [batch, seq]; None: each row is one document
    positions: jax.Array  # [batch, seq]: where a KV cache stores each token
    # A key for LoRA dropout while training, folded with each layer's index on the way down; None otherwise.
    dropout: jax.Array | None = None

    def folded(self, index) -> Context:
        """The context of sub-stack `index`: its own dropout key."""
        return self if self.dropout is None else self._replace(dropout=jax.random.fold_in(self.dropout, index))


def make_context(
    tokens: jax.Array,
    segment_ids: jax.Array | None,
    positions: jax.Array | None,
    head_dim: int,
    rope_theta: float,
    rope_scaling: RopeScaling | None = None,
) -> Context:
    """RoPE tables (positions default to 0..seq-1) and the documents' segment ids."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else positions
    return Context(rope_tables(positions, rope_frequencies(head_dim, rope_theta, rope_scaling)), segment_ids, positions)


def norm(x: jax.Array, p: dict, kind: str, eps: float) -> jax.Array:
    """RMSNorm or LayerNorm, computed in fp32 and returned in x's dtype."""
    xf = x.astype(jnp.float32)
    if kind == "layernorm":
        xf = xf - xf.mean(-1, keepdims=True)
    y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps) * p["scale"].astype(jnp.float32)
    if "bias" in p:
        y = y + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """The angular frequency of each rotated pair, [head_dim / 2], stretched as `scaling` (a
    model's `rope_scaling`) says: 'linear' divides them all by its factor; 'llama3' divides those
    whose wavelength exceeds the original context / low_freq_factor, keeps those under
    original context / high_freq_factor, and interpolates between."""
    freqs = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None or scaling.type == "none":
        return freqs
    if scaling.type == "linear":
        return freqs / scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    kept = jnp.clip((scaling.original_max_len * freqs / (2 * jnp.pi) - low) / (high - low), 0.0, 1.0)
    return (1 - kept) * freqs / scaling.factor + kept * freqs


def rope_tables(positions: jax.Array, freqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [batch, seq, 1, head_dim] for the rotate-half (Llama) convention."""
    angles = positions.astype(jnp.float32)[..., None] * freqs
    angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return (xf * cos + jnp.concatenate([-x2, x1], -1) * sin).astype(x.dtype)


def attention_mask(q_index: jax.Array, k_index: jax.Array, q_segment: jax.Array, k_segment: jax.Array) -> jax.Array:
    """[batch, 1, q, k] boolean: causal by sequence index, and only within the same segment."""
    causal = k_index[:, None, :] <= q_index[:, :, None]
    same_doc = k_segment[:, None, :] == q_segment[:, :, None]
    return (causal & same_doc)[:, None]


def document_mask(segment_ids: jax.Array | None, length: int) -> jax.Array:
    """The mask of a sequence attending to itself: causal, within documents (one per row if None)."""
    index = jnp.arange(length)[None]
    segments = jnp.ones_like(index) if segment_ids is None else segment_ids
    return attention_mask(index, index, segments, segments)


def attend(q: jax.Array, k: Entries, v: Entries, mask: jax.Array, kv_layout: str = "bskd") -> jax.Array:
    """Grouped-query attention as einsums under an explicit mask (keys of any length).
    q: [b, t, heads, d]; k, v: [b, s, kv_heads, d], or [b, kv_heads, s, d] with `kv_layout`
    "bksd" (a KV cache's read, whose entries may be `Int8`); mask: [b, 1, t, s]. Softmax in fp32."""
    b, t, nh, d = q.shape
    (k, k_scale), (v, v_scale) = _cached(k, q.dtype), _cached(v, q.dtype)
    kv = k.shape[kv_layout.index("k")]
    q = q.reshape(b, t, kv, nh // kv, d)
    scores = jnp.einsum(f"btkgd,{kv_layout}->bkgts", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    scores = jnp.where(mask[:, :, None], scores * k_scale, NEG_INF)
    probs = (jax.nn.softmax(scores, axis=-1) * v_scale).astype(v.dtype)
    out = jnp.einsum(f"bkgts,{kv_layout}->btkgd", probs, v)
    return out.reshape(b, t, nh, d)


def _cached(entries: Entries, dtype) -> tuple[jax.Array, jax.Array | float]:
    """(entries in `dtype`, the scale of each position's scores [b, kv_heads, 1, 1, s], or 1): an
    int8 key's scale (of a cache's read, [b, kv_heads, s, 1]) multiplies its scores, an int8
    value's its probabilities."""
    if isinstance(entries, Int8):
        return entries.q.astype(dtype), jnp.swapaxes(entries.scale, -1, -2)[:, :, None]
    return entries.astype(dtype), 1.0


def library_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, implementation: str = "cudnn"
) -> jax.Array:
    """`jax.nn.dot_product_attention`: causal by its own flag; packed documents through its mask,
    a [batch, 1, t, t] array built per layer (t² bytes per sequence, 16 MiB at t = 4096)."""
    mask = None if segment_ids is None else document_mask(segment_ids, q.shape[1])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


def pallas_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, interpret: bool = False
) -> jax.Array:
    """JAX's Pallas (Triton) flash attention: segment ids and causality inside the kernel, no
    mask in memory. No GQA: it needs as many kv heads as query heads."""
    return mha(q, k, v, segment_ids, sm_scale=q.shape[-1] ** -0.5, causal=True, interpret=interpret)


def per_device(kernel):
    """`kernel(q, k, v, segment_ids)` on each device's own batch rows and heads: a custom kernel
    cannot be split by the compiler, so it runs under a `shard_map` over the mesh axes not yet
    manual (none inside the pipeline)."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    if mesh.empty or not auto:
        return kernel
    spec = partial(manual_spec, manual_axes=auto)
    q, kv = spec("batch", None, "heads", None), spec("batch", None, "kv_heads", None)
    return jax.shard_map(kernel, in_specs=(q, kv, kv, spec("batch", None)), out_specs=q, axis_names=auto)


def self_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, implementation: str = "xla"
) -> jax.Array:
    """A sequence attending to itself, causally and within documents, by the named implementation."""
    if implementation == "xla":
        return attend(q, k, v, document_mask(segment_ids, q.shape[1]))
    kernel = pallas_attention if implementation == "pallas" else library_attention
    return per_device(kernel)(q, k, v, segment_ids)


def _project_qkv(
    x: jax.Array, qkv: dict, rope: tuple[jax.Array, jax.Array], project: Project, dropout: jax.Array | None = None
) -> tuple[jax.Array, ...]:
    q, k, v = project(x, tuple(adapted(qkv, n, dropout) for n in "qkv"), "bte,ehd->bthd")
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return tuple(checkpoint_name(a, "qkv_proj") for a in (q, k, v))


def attention(
    x: jax.Array,
    qkv: dict,
    o_proj: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    segment_ids: jax.Array | None,
    dropout: jax.Array | None = None,
    implementation: str = "xla",
    project: Project = einsum_projections,
) -> jax.Array:
    """Self-attention on this device's heads; the caller sums partial outputs over `tensor`.
    `dropout`: the layer's key for LoRA dropout while training."""
    q, k, v = _project_qkv(x, qkv, rope, project, dropout)
    ctx = checkpoint_name(self_attention(q, k, v, segment_ids, implementation), "attn_out")
    return project(ctx, (with_dropout(o_proj, dropout, "o_proj"),), "bthd,hde->bte")[0]


KERNEL_SPLITS, KERNEL_BLOCK_PAGES = 16, 8  # the Pallas paged kernel's defaults: partitions, and pages a block


def paged_decode_attention(
    q: jax.Array,
    keys: Entries,
    values: Entries,
    layer: jax.Array,
    table: jax.Array,
    positions: jax.Array,
    interpret: bool = False,
) -> jax.Array:
    """One new token per row (q [b, 1, heads, d] at `positions` [b, 1]) over a layer's pages in
    the pools (see `cache`) by JAX's Pallas paged-attention kernel, which reads each row's live
    pages only. The kernel wants [kv heads, pages, page, d]; a pool page holds every kv head side
    by side, so each kv head runs alone over the pool seen as [1, layers × pages × kv heads, page,
    d]. A GPU kernel: `interpret` runs it in the Pallas interpreter (any backend).

    The kernel reads a table in `KERNEL_SPLITS` partitions at once, each in blocks of whole
    pages, all of equal size: the table is padded (with pages past every row's length, masked as
    any there) to a width of partitions of whole blocks, up to `KERNEL_BLOCK_PAGES` pages each,
    where a gcd of the width falls to one partition of single pages for a width with no factor of
    2 (`serve.max_len`'s widest bucket often has one)."""
    layers, pages, kv_heads, page_size, d = jax.tree.leaves(keys)[0].shape
    b, _, heads, _ = q.shape
    partition = -(-table.shape[1] // KERNEL_SPLITS)  # pages, before rounding up to whole blocks
    block = min(KERNEL_BLOCK_PAGES, 1 << (partition - 1).bit_length())  # a power of two: it divides the partition
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % (KERNEL_SPLITS * block))))
    flat = partial(jax.tree.map, lambda p: p.reshape(1, layers * pages * kv_heads, page_size, *p.shape[4:]))
    (k, k_scale), (v, v_scale) = (_kernel_pages(flat(e)) for e in (keys, values))
    kernel = partial(
        paged_attention, k_pages=k, v_pages=v, lengths=positions[:, 0] + 1, k_scales_pages=k_scale,
        v_scales_pages=v_scale, k_splits=KERNEL_SPLITS, pages_per_compute_block=block,
        interpret=interpret,
    )  # fmt: skip

    def head(q, h):  # q [b, heads per kv head, d] of kv head h
        return kernel(q, block_tables=(layer * pages + table) * kv_heads + h)

    grouped = q[:, 0].reshape(b, kv_heads, heads // kv_heads, d) * d**-0.5
    out = jax.vmap(head, in_axes=(1, 0), out_axes=1)(grouped, jnp.arange(kv_heads))
    return out.reshape(b, 1, heads, d)


def _kernel_pages(entries: Entries) -> tuple[jax.Array, jax.Array | None]:
    if isinstance(entries, Int8):
        return entries.q, entries.scale[..., 0]
    return entries, None


BLOCK_TOKENS = 256  # positions one step of `blockwise_paged_attention` reads: its copy stays small


def blockwise_paged_attention(
    q: jax.Array, keys: Entries, values: Entries, layer: jax.Array, table: jax.Array, positions: jax.Array
) -> jax.Array:
    """New tokens q [b, t, heads, d] at `positions` [b, t] (-1: padding) over the pages `table`
    [b, P] names in `layer` of the pools (see `cache`), causally: a loop over blocks of the
    table's pages that stops after the last block any row has live, with an online softmax (fp32)
    across blocks. Each step copies one block of pages, never the whole table's, and the work
    follows the longest live row, not the table's width."""
    b, t, nh, d = q.shape
    page_size, width = jax.tree.leaves(keys)[0].shape[3], table.shape[1]
    block = min(width, max(1, BLOCK_TOKENS // page_size))  # pages a step reads
    span = block * page_size
    kv = jax.tree.leaves(keys)[0].shape[2]
    q = q.reshape(b, t, kv, nh // kv, d)

    def step(i, carry):
        top, total, out = carry  # running max and sum of exp(score) [b, kv, g, t]; the weighted values
        # A width that blocks do not divide ends in a block moved back to fit, whose pages the
        # block before it read are masked out.
        first = jnp.minimum(i * block, width - block)
        pages = jax.lax.dynamic_slice_in_dim(table, first, block, axis=1)
        (k, k_scale), (v, v_scale) = (_cached(read(pool, layer, pages), q.dtype) for pool in (keys, values))
        scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) * k_scale / jnp.sqrt(d)
        at = first * page_size + jnp.arange(span)
        live = (at >= i * span) & (at <= positions[:, None, None, :, None])  # [b, 1, 1, t, span]
        scores = jnp.where(live, scores, NEG_INF)
        new_top = jnp.maximum(top, scores.max(-1))
        weights = jnp.exp(scores - new_top[..., None])
        fade = jnp.exp(top - new_top)
        values_read = jnp.einsum("bkgts,bksd->bkgtd", (weights * v_scale).astype(v.dtype), v)
        return new_top, total * fade + weights.sum(-1), out * fade[..., None] + values_read

    zeros = (q.astype(jnp.float32) * 0).transpose(0, 2, 3, 1, 4)  # [b, kv, g, t, d]; in a shard_map, varying as q is
    start = (zeros[..., 0] + NEG_INF, zeros[..., 0], zeros)
    blocks = -(-width // block)
    if blocks == 1:  # no loop to stop early
        _, total, out = step(0, start)
    else:
        steps = jnp.clip(-(-(jnp.max(positions) + 1) // span), 1, blocks)
        _, total, out = jax.lax.fori_loop(0, steps, step, start)
    out = (out / total[..., None]).astype(q.dtype)  # [b, kv, g, t, d]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nh, d)


def cached_attention(
    x: jax.Array,
    qkv: dict,
    o_proj: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    keys: Entries,
    values: Entries,
    layer: jax.Array,
    table: jax.Array,
    positions: jax.Array,
    project: Project = einsum_projections,
    implementation: str = "xla",
) -> tuple[jax.Array, Entries, Entries]:
    """Attention of new tokens at `positions` [b, t] (consecutive per row; -1: padding) over the
    pages `table` [b, P] names in `layer` of the pools (see `cache`), with their own keys and
    values written in first: (output, keys, values). The XLA path reads the pages a block at a
    time (`blockwise_paged_attention`); `implementation` 'pallas' runs single-token steps through JAX's
    paged kernel instead."""
    q, k, v = _project_qkv(x, qkv, rope, project)
    keys, values = (write(pool, encode(new, pool), layer, table, positions) for pool, new in ((keys, k), (values, v)))
    if implementation == "pallas" and q.shape[1] == 1:
        ctx = paged_decode_attention(q, keys, values, layer, table, positions)
    else:
        ctx = blockwise_paged_attention(q, keys, values, layer, table, positions)
    (out,) = project(ctx, (o_proj,), "bthd,hde->bte")
    return out, keys, values


def feed_forward(
    x: jax.Array, p: dict, dropout: jax.Array | None = None, *, activation: str, project: Project = einsum_projections
) -> jax.Array:
    """GLU (SwiGLU / GeGLU) or plain GELU MLP on this device's slice of `mlp`; `dropout` as for
    `attention`."""
    if activation == "gelu":
        (up,) = project(x, (adapted(p, "up", dropout),), "bte,em->btm")
        hidden = jax.nn.gelu(up)
    else:
        gate, up = project(x, (adapted(p, "gate", dropout), adapted(p, "up", dropout)), "bte,em->btm")
        act = jax.nn.silu if activation == "swiglu" else jax.nn.gelu
        hidden = act(gate) * up
    hidden = checkpoint_name(hidden, "mlp_in")
    return project(hidden, (adapted(p, "down", dropout),), "btm,me->bte")[0]
