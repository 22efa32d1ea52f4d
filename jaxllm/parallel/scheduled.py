"""A pipeline run by a timetable (`parallel/timetable.py`: 1F1B and zero-bubble, each interleaved or
not), whose forwards and backwards of different microbatches interleave, so a stage holds a few
microbatches' inputs in flight where GPipe holds all M.

Such a loop cannot be JAX's transpose of a forward loop: a microbatch's backward starts before the
last microbatch's forward. So the model's ends run inside it, and one `lax.scan` inside a
`shard_map` (manual over every mesh axis) computes the loss and every gradient at once: in each
step a stage back-propagates one work unit (recomputing its forward from the stashed input, as
GPipe's rematerialised iterations do) and forwards another, then hands activations on and
gradients back with one `ppermute` each. Under zero-bubble a unit's forward, input gradient and
weight gradients are the three parts of one traced pass (`split_backward.py`): the forward keeps
its residuals instead of being recomputed, the backward keeps its taps, and a third cell computes
a put-off unit's weight gradients from them. In a step where the last virtual stage forwards, every
stage takes its output and computes the loss on its block of the head's vocabulary, split over
`tensor` × `stage` (a vocab-parallel cross-entropy, as in "Balancing Pipeline Parallelism with
Vocabulary Parallelism"): the head costs each stage 1/S of itself, where on the last stage alone
it would lengthen every step that stage forwards, and no device holds more than its block of the
head and the block's fp32 gradient sum. The first stage embeds each microbatch as its units run,
from its block of the table's vocabulary (as the table is stored: split over `tensor`), so no
device holds the embedded batch or its gradient, only O(S) microbatches' activations; each unit
builds its microbatch's RoPE tables from the positions for the same reason. A `custom_vjp` makes
the result an ordinary differentiable function of the stage weights, the head and the embedding
table, whose backward pass only scales the gradients it already holds.

Weights as in `pipeline.py`: the loop computes with the compute-dtype `copies` gathered once per
step; each backward's weight gradients reach fp32 sinks (never rounded to bf16) and add up per
device in fp32, and are reduced over the data-parallel devices once, after the loop.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.config import Schedule
from jaxllm.parallel import timetable
from jaxllm.parallel.collectives import all_gather, varying_axes, varying_over
from jaxllm.parallel.pipeline import (
    MANUAL_AXES,
    loop_weight,
    reduced_grad,
    stage_major,
    stage_major_arrays,
    varying_like,
)
from jaxllm.parallel.rules import GATHERED_RULES, active_rules, as_tuple, is_axes, manual_spec
from jaxllm.parallel.schedule import split_microbatches
from jaxllm.parallel.split_backward import split_backward
from jaxllm.parallel.tensor_parallel import RESIDUAL, vocab_split_lookup, vocab_split_lookup_grad
from jaxllm.parallel.timetable import IDLE

# The head's vocabulary inside the loop: each `tensor` block, as the head is stored, split over the stages.
VOCAB_AXES = ("tensor", "stage")


def scheduled_loss(
    groups, specs, head, table, tokens, ctx, targets, mask, schedule: Schedule, stack_fn, loss_fn, copies, forward_loss,
    dtype, rope,
):  # fmt: skip
    """The loss of `tokens` [batch, seq], embedded by `table` [vocab, embed] (fp32, cast to `dtype`)
    on the first stage, through the stages (each microbatch's RoPE tables `rope(positions)` built as
    its units run, `ctx.rope` unused), summed over the microbatches of `loss_fn(head, out,
    targets, mask, VOCAB_AXES)`, the last virtual stage's output `out` through the head, whose
    `head["matrix"]` [embed, vocab] is split over `VOCAB_AXES` along the vocabulary (`out`, `targets`
    and `mask` whole along the sequence); differentiable in `groups` (fp32, pipeline view), `head`
    (a dict of fp32 arrays) and `table`. `targets` and `mask` are [batch, seq]. Where nothing
    differentiates it (an evaluation), `forward_loss` (the same arguments) computes it without the
    backwards."""

    @jax.custom_vjp
    def loss(groups, head, table, copies, tokens, ctx, targets, mask):
        return forward_loss(groups, head, table, copies, tokens, ctx, targets, mask)

    def forward(groups, head, table, copies, tokens, ctx, targets, mask):
        total, *grads = _run(
            specs, head, table, tokens, ctx, targets, mask, schedule, stack_fn, loss_fn, copies, dtype, rope
        )
        return total, grads

    def backward(grads, cotangent):
        scaled = jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), grads)
        return (*scaled, None, None, None, None, None)

    loss.defvjp(forward, backward)
    return loss(groups, head, table, copies, tokens, ctx, targets, mask)


def _run(
    specs, head, embedding, tokens, ctx, targets, mask, schedule: Schedule, stack_fn, loss_fn, copies, dtype, rope
):
    """(loss sum, gradients of the stage weights (from their `copies`), of the head, of the table)."""
    s, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    table = timetable.of(schedule)
    last = (s - 1, v - 1)  # the last virtual stage: (stage, chunk)
    axes = stage_major(specs)
    spec_of = partial(manual_spec, manual_axes=MANUAL_AXES)
    shard_specs = jax.tree.map(lambda a: spec_of(*a), axes, is_leaf=is_axes)
    copy_specs = jax.tree.map(lambda a: spec_of(*a, rules=GATHERED_RULES), axes, is_leaf=is_axes)
    micro_spec = spec_of(None, *RESIDUAL, rules=active_rules())  # [M, mb, seq, embed]
    seq_axes = as_tuple(micro_spec[2])  # the sequence's split in the loop: `tensor`'s under sequence parallelism
    token_spec = P(None, micro_spec[1])  # tokens, targets and mask whole along the sequence
    embedding_spec = spec_of("vocab", None, rules=GATHERED_RULES)  # its vocabulary split as it is stored
    embedding_axes = as_tuple(embedding_spec[0])
    head_specs = jax.tree.map(lambda _: P(), head) | {"matrix": P(None, VOCAB_AXES)}
    split = partial(split_microbatches, m=m)
    ctx_micro = jax.tree.map(split, ctx._replace(rope=None, dropout=None))  # RoPE tables: built per unit, not O(M)
    to_next = [(j, (j + 1) % s) for j in range(s)]
    to_previous = [(j, (j - 1) % s) for j in range(s)]
    columns = tuple(jnp.asarray(a) for a in (
        table.forward, table.backward, table.forward_x, table.backward_x, table.backward_g,
        table.received_x, table.received_g, table.loss_g, table.weight, table.forward_r, table.backward_r,
        table.backward_w, table.weight_w,
    ))  # fmt: skip

    def one_stage(copies, head, embedding, tokens, ctx_micro, targets, mask, dropout):
        stage = jax.lax.axis_index("stage")
        # Varies as the activations do: over the batch's devices, the stages and the sequence's split.
        acts = varying_over(jnp.zeros((), dtype), tuple(sorted({*varying_axes(tokens), *seq_axes, "stage"})))
        copies = jax.tree.map(lambda c: varying_like(c[0], acts), copies)
        # Per-device like the activations, so that no gradient is summed over devices inside a branch
        # some stages skip (a collective there would wait for them forever).
        head, embedding = jax.tree.map(lambda h: varying_like(h, acts), (head, embedding))
        grad_axes = jax.tree.map(lambda c: varying_axes(c) | varying_axes(acts), copies)
        zeros = jax.tree.map(lambda c: jnp.zeros(c.shape, jnp.float32), copies)
        grads = jax.tree.map(lambda z, a: varying_over(z, tuple(sorted(a))), zeros, grad_axes)
        head_grads = jax.tree.map(lambda h: varying_like(jnp.zeros(h.shape, jnp.float32), h), head)
        embedding_grads = varying_like(jnp.zeros(embedding.shape, jnp.float32), embedding)
        pieces = jax.lax.axis_size(seq_axes) if seq_axes else 1
        shape = (tokens.shape[1], tokens.shape[2] // pieces, embedding.shape[1])  # a unit's input
        xbuf = varying_like(jnp.zeros((table.x_slots + 1, *shape), dtype), acts)
        gbuf = varying_like(jnp.zeros((table.g_slots + 1, *shape), dtype), acts)
        # Every stage, and every device of a sequence's split, computes the same whole loss: it is summed once.
        total_axes = varying_axes(acts) - set(seq_axes) - {"stage"}
        total = varying_over(jnp.zeros((), jnp.float32), tuple(sorted(total_axes)))

        def context(unit):
            chunk, j = unit // m, unit % m
            # Each stage, chunk and microbatch (`unit`) draws its own LoRA dropout masks.
            unit_ctx = jax.tree.map(lambda a: a[j], ctx_micro)
            unit_ctx = unit_ctx._replace(rope=rope(unit_ctx.positions), dropout=dropout)
            return chunk, j, unit_ctx.folded(stage).folded(unit)

        def sinks_of(chunk_copies):
            return jax.tree.map(lambda c: varying_like(jnp.zeros(c.shape, jnp.float32), c), chunk_copies)

        def apply(sinks, inputs, rest):
            chunk_copies, unit_ctx = rest
            weights = jax.tree.map(loop_weight, chunk_copies, sinks, specs)
            return stack_fn(weights, inputs, unit_ctx)

        def add_grads(grads, chunk, dsinks):
            return jax.tree.map(
                lambda g, d, a: g.at[chunk].add(varying_over(d, tuple(sorted(a)))), grads, dsinks, grad_axes
            )

        def first(chunk):  # virtual stage 0
            return (stage == 0) & (chunk == 0)

        def stage_input(xbuf, slot, chunk, j):
            """Virtual stage 0 embeds its microbatch; every other reads its stashed input."""
            embedded = partial(vocab_split_lookup, embedding, tokens[j], embedding_axes, seq_axes)
            return jax.lax.cond(first(chunk), lambda: varying_like(embedded().astype(dtype), acts), lambda: xbuf[slot])

        def whole(a):  # the last stage's output whole along the sequence; the backward scatters its gradient back
            return all_gather(a, seq_axes, 1) if seq_axes else a

        # Split schedules: a unit's forward, input gradient and weight gradients as three parts of one
        # traced pass (`split_backward.py`), the residuals and taps kept between them in buffers.
        halves, rbuf, wbuf = None, [], []
        if table.split:
            # Traced as the loop runs a unit: at a unit index that varies over the stages.
            chunk, j, unit_ctx = context(columns[0][0][stage])
            chunk_copies = jax.tree.map(lambda c: c[chunk], copies)
            inputs = stage_input(xbuf, table.x_slots, chunk, j)
            halves = split_backward(apply, sinks_of(chunk_copies), inputs, (chunk_copies, unit_ctx))
            rbuf = [_buffer(a, table.r_slots) for a in halves.avals(halves.residuals)]
            wbuf = [_buffer(a, table.w_slots) for a in halves.avals(halves.taps)]

        def back(carry, unit, x_slot, g_slot, residuals):
            """The unit's input gradient and, split, its taps (its weight gradients put off); else
            its weight gradients too."""
            xbuf, gbuf, embedding_grads, grads, head_grads, total = carry
            chunk, j, unit_ctx = context(unit)
            inputs = stage_input(xbuf, x_slot, chunk, j)
            chunk_copies = jax.tree.map(lambda c: c[chunk], copies)
            rest = (chunk_copies, unit_ctx)
            taps = []
            if halves is None:
                _, vjp = jax.vjp(lambda sinks, inputs: apply(sinks, inputs, rest), sinks_of(chunk_copies), inputs)
                dsinks, dx = vjp(gbuf[g_slot])
                grads = add_grads(grads, chunk, dsinks)
            else:
                dx, taps = halves.input_grad(sinks_of(chunk_copies), inputs, rest, gbuf[g_slot], residuals)
            embedding_grads = jax.lax.cond(
                first(chunk),  # its input gradient is the embedding's
                lambda g: vocab_split_lookup_grad(g, tokens[j], dx, embedding_axes, seq_axes),
                lambda g: g,
                embedding_grads,
            )
            return (xbuf, gbuf, embedding_grads, grads, head_grads, total), (dx, _typed_like(taps, wbuf))

        def weigh(carry, unit, taps):
            """The put-off weight gradients of a unit (split)."""
            xbuf, gbuf, embedding_grads, grads, head_grads, total = carry
            chunk, _, unit_ctx = context(unit)
            chunk_copies = jax.tree.map(lambda c: c[chunk], copies)
            dsinks = halves.weight_grad(sinks_of(chunk_copies), (chunk_copies, unit_ctx), taps)
            grads = add_grads(grads, chunk, dsinks)
            return xbuf, gbuf, embedding_grads, grads, head_grads, total

        def fore(carry, unit, x_slot):
            """The unit's output and, split, the residuals its backward reads."""
            xbuf, *_ = carry
            chunk, j, unit_ctx = context(unit)
            inputs = stage_input(xbuf, x_slot, chunk, j)
            chunk_copies = jax.tree.map(lambda c: c[chunk], copies)
            if halves is None:
                return carry, (stack_fn(chunk_copies, inputs, unit_ctx), [])
            out, residuals = halves.forward(sinks_of(chunk_copies), inputs, (chunk_copies, unit_ctx))
            return carry, (out, _typed_like(residuals, rbuf))

        def with_loss(carry, sent_x, unit, loss_slot):
            """Every stage's share of the loss of the last virtual stage's output `sent_x` (on the
            last stage), the gradient of that output to the last stage's `loss_slot`."""
            xbuf, gbuf, embedding_grads, grads, head_grads, total = carry
            j = unit % m
            out = jax.lax.psum(jnp.where(stage == last[0], sent_x, jnp.zeros_like(sent_x)), "stage")
            value, vjp = jax.vjp(
                lambda head, out: loss_fn(head, whole(out), targets[j], mask[j], VOCAB_AXES), head, out
            )
            dhead, dout = vjp(jnp.ones_like(value))
            head_grads = jax.tree.map(lambda g, d: g + varying_like(d, g), head_grads, dhead)
            gbuf = gbuf.at[loss_slot].set(varying_like(dout, gbuf))
            return xbuf, gbuf, embedding_grads, grads, head_grads, total + varying_like(value, total)

        def step(carry, row):
            (forward, backward, forward_x, backward_x, backward_g, received_x, received_g, loss_g, weight,
             forward_r, backward_r, backward_w, weight_w) = (a[stage] for a in row)  # fmt: skip
            carry, rbuf, wbuf, (r_slot, stored_r, w_slot, stored_w) = carry
            idle = jnp.zeros_like(carry[0][0])
            # The residual and tap buffers stay out of the branches. What the last step's cells
            # stored is written first, then this step's cells read: XLA keeps a buffer read
            # before it is written in the same step twice. A slot read in a step may be written
            # by that step's cells (it is, in the next); an idle cell writes the scratch slot.
            rbuf = [b.at[r_slot].set(r) for b, r in zip(rbuf, stored_r, strict=True)]
            wbuf = [b.at[w_slot].set(t) for b, t in zip(wbuf, stored_w, strict=True)]
            if halves is not None:
                taps = [b[weight_w] for b in wbuf]
                carry = jax.lax.cond(weight != IDLE, lambda c: weigh(c, weight, taps), lambda c: c, carry)
            residuals = [b[backward_r] for b in rbuf]
            carry, (sent_g, taps) = jax.lax.cond(
                backward != IDLE,
                lambda c: back(c, backward, backward_x, backward_g, residuals),
                lambda c: (c, (idle, [jnp.zeros_like(b[0]) for b in wbuf])),
                carry,
            )
            carry, (sent_x, residuals) = jax.lax.cond(
                forward != IDLE,
                lambda c: fore(c, forward, forward_x),
                lambda c: (c, (idle, [jnp.zeros_like(b[0]) for b in rbuf])),
                carry,
            )
            stored = (forward_r, residuals, backward_w, taps)
            # The same on every device (the table's row is), so every stage joins the loss's collectives.
            final = row[0][last[0]]  # the last stage's forward
            carry = jax.lax.cond(
                (final != IDLE) & (final // m == last[1]),
                lambda c: with_loss(c, sent_x, final, loss_g),
                lambda c: c,
                carry,
            )
            xbuf, gbuf, *rest = carry
            xbuf = xbuf.at[received_x].set(jax.lax.ppermute(sent_x, "stage", to_next))
            gbuf = gbuf.at[received_g].set(jax.lax.ppermute(sent_g, "stage", to_previous))
            return ((xbuf, gbuf, *rest), rbuf, wbuf, stored), None

        scratch = [varying_over(jnp.int32(n), ("stage",)) for n in (table.r_slots, table.w_slots)]  # as a row's slots
        nothing = (scratch[0], [jnp.zeros_like(b[0]) for b in rbuf], scratch[1], [jnp.zeros_like(b[0]) for b in wbuf])
        carry = ((xbuf, gbuf, embedding_grads, grads, head_grads, total), rbuf, wbuf, nothing)
        ((_, _, embedding_grads, grads, head_grads, total), *_), _ = jax.lax.scan(step, carry, columns)
        grads = jax.tree.map(lambda g, spec: reduced_grad(g, P(*spec[1:]))[None], grads, shard_specs)
        # Summed over the devices that hold the same block of the head, then each `tensor` block put
        # together from its stages' blocks: it leaves as the head is stored, which XLA then slices
        # (from blocks over `stage` it would rebuild the whole matrix on every device to re-split it).
        head_grads, embedding_grads = jax.tree.map(
            _summed_over_copies, (head_grads, embedding_grads), (head_specs, embedding_spec)
        )
        width = head_grads["matrix"].shape[1]
        joined = jnp.zeros((head_grads["matrix"].shape[0], width * s), jnp.float32)
        joined = jax.lax.dynamic_update_slice_in_dim(joined, head_grads["matrix"], stage * width, 1)
        head_grads["matrix"] = jax.lax.psum(joined, "stage")
        total = jax.lax.psum(total, tuple(sorted(varying_axes(total))))
        return total, grads, head_grads, embedding_grads

    run = jax.shard_map(
        one_stage,
        in_specs=(copy_specs, head_specs, embedding_spec, token_spec, token_spec, token_spec, token_spec, P()),
        out_specs=(P(), shard_specs, head_specs | {"matrix": P(None, "tensor")}, embedding_spec),
        axis_names=MANUAL_AXES,
    )
    tokens, targets, mask = (split(a) for a in (tokens, targets, mask))
    total, grads, head_grads, embedding_grads = run(
        copies, head, embedding, tokens, ctx_micro, targets, mask, ctx.dropout
    )
    return total, stage_major_arrays(grads), head_grads, embedding_grads


def _summed_over_copies(g: jax.Array, spec: P) -> jax.Array:
    """A gradient summed over the devices that hold the same block of its weight (split as `spec`)."""
    return jax.lax.psum(g, tuple(sorted(varying_axes(g) - {a for p in spec for a in as_tuple(p)})))


def _buffer(aval, slots: int) -> jax.Array:
    """Zeros for `slots` values like `aval` and a scratch slot, varying as it does."""
    return varying_over(jnp.zeros((slots + 1, *aval.shape), aval.dtype), tuple(sorted(aval.manual_axis_type.varying)))


def _typed_like(values: list, buffers: list) -> list:
    """`values` typed as varying over what their `buffers` vary over, to be stored in them."""
    return [varying_over(v, tuple(sorted(varying_axes(b)))) for v, b in zip(values, buffers, strict=True)]
