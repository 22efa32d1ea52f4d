"""Communication per device per step, collective by collective, for the configured layout.

Each `Transfer` is one kind of collective on one group of mesh axes: the bytes of the array it
works on in its group (an all-reduce's or reduce-scatter's input, an all-gather's output, a
permute's array; what `hlo.collective_bytes` reads from a compiled step) and how often a step
runs it. `wire_bytes` turns that into bytes each device sends, for ring algorithms.

What the counts follow (the compiled step, `tests/test_plan.py`):
- tensor parallelism reduces each block's output once forward and once backward, and gathers
  each block's input with sequence parallelism; a rebuilt layer runs both input gathers again
  and the attention block's reduction (the feed-forward's output is the layer's output, which the
  backward does not need); a rebuilt group runs every reduction but its last. A pipeline rebuilds
  each iteration's stage on top of that, and runs every iteration, bubbles included;
- gradients are reduced once per gradient-accumulation microstep: over `fsdp` (reduce-scatter),
  then over `data` (all-reduce, or reduce-scatter under ZeRO-1, whose updated params are
  all-gathered after the update). A shared QKV's gradient is reduced once per layer applying it;
- FSDP gathers each layer's weights forward and again backward (a per-layer remat gathers the
  shared QKV once per layer); a pipeline gathers its stage's weights once per step, in the
  compute dtype, and reduces their fp32 gradient sums once per microstep.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxllm.config import MESH_AXES, TABLE_SCHEDULES, RunConfig
from jaxllm.parallel import timetable
from jaxllm.parallel.rules import RULES
from jaxllm.plan.hlo import KINDS
from jaxllm.plan.memory import _itemsize, _per_device_bytes, mesh_sizes, specs_of

RING = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


@dataclasses.dataclass(frozen=True)
class Transfer:
    what: str
    op: str  # an HLO collective: all-reduce, reduce-scatter, all-gather, collective-permute
    axes: tuple[str, ...]  # the mesh axes of its groups
    array: float  # bytes of the group's whole array, per run
    count: float  # runs per step

    @property
    def kind(self) -> str:
        return KINDS[self.op]

    @property
    def bytes(self) -> float:
        return self.array * self.count

    def group(self, mesh_sizes: dict[str, int]) -> int:
        return math.prod(mesh_sizes[a] for a in self.axes)

    def wire_bytes(self, mesh_sizes: dict[str, int]) -> float:
        """Bytes each device sends, by a ring (a permute sends its array once)."""
        return self.bytes * RING[self.op](self.group(mesh_sizes))


def _recomputed(remat: str, share: int) -> tuple[float, float]:
    """(reductions, gathers) of tensor-parallel blocks a remat policy runs again per layer."""
    if remat == "none":
        return 0.0, 0.0
    return (2 - 1 / share if remat == "group" else 1.0), 2.0


def communication(cfg: RunConfig, backend: str = "gpu") -> list[Transfer]:
    """Every transfer of a train step on the configured mesh (sizes of -1 count as 1), as the
    `backend` compiles it: XLA:CPU runs 16-bit collectives in fp32, so `--compile` on fake CPU
    devices compares with backend 'cpu'."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    n = mesh_sizes(cfg)
    schedule, accum, share, layers = cfg.parallel.pipeline, t.grad_accum_steps, m.qkv_share_every, m.num_layers
    specs = specs_of(m)
    tensor_only = jax.sharding.AbstractMesh((1, 1, 1, n["tensor"]), MESH_AXES)

    def split(tree, itemsize) -> float:  # bytes of `tree` split over `tensor` alone
        return _per_device_bytes(tree, RULES, tensor_only, itemsize)

    grad = _itemsize(jnp.float32)
    weights = {name: split(specs[name], grad) for name in ("embed", "final_norm", "groups")}
    head = split(specs["lm_head"], grad) if "lm_head" in specs else weights["embed"]
    qkv = split(specs["groups"]["qkv"], grad)
    every = sum(weights.values()) + (head if "lm_head" in specs else 0)
    stages = n["stage"] if schedule else 1
    timetabled = schedule is not None and schedule.kind in TABLE_SCHEDULES
    rows = t.batch_size // (n["data"] * n["fsdp"]) // accum  # a microstep's sequences per device
    compute_dtype = jnp.float32 if backend == "cpu" else m.dtype  # what 16-bit collectives move
    act = rows * t.seq_len * m.hidden * jnp.dtype(compute_dtype).itemsize  # a block's [rows, seq, hidden]
    reduces, gathers = _recomputed(m.remat, share)
    per_layer_remat = m.remat not in ("none", "group")
    out = []

    def add(what, op, axes, array, count):
        if count and array and math.prod(n[a] for a in axes) > 1:
            out.append(Transfer(what, op, axes, array, count))

    # Tensor parallelism: the blocks, then the embedding lookup and the head.
    if schedule is None:
        block, runs, rebuilt = act, layers, 0
    else:
        block = act / schedule.microbatches
        runs = schedule.iterations * layers // (stages * schedule.repeats)
        # each iteration's stage is rebuilt, except that under remat `group` a stage of one group
        # is rebuilt by that group's own remat, and a split backward keeps its forward's residuals
        one_group = layers // (stages * schedule.repeats) == share
        rebuilt = 0 if (m.remat == "group" and one_group) or schedule.split else 2
    tp, table = ("tensor",), weights["embed"] * n["tensor"]
    # GPipe's head takes each stage's slice of the sequence; a timetable's, whole microbatches on every stage
    head_split = 1 if timetabled else stages
    block_reduces, block_gathers = accum * runs * (4 + rebuilt + reduces), accum * runs * (4 + rebuilt + gathers)
    if p.sequence_parallel:
        add("tensor: block outputs reduce-scattered", "reduce-scatter", tp, block, block_reduces)
        add("tensor: block inputs all-gathered", "all-gather", tp, block, block_gathers)
        add("tensor: the head's input all-gathered", "all-gather", tp, act / head_split, accum)
    else:
        add("tensor: block outputs all-reduced", "all-reduce", tp, block, block_reduces)
    if timetabled:  # the first stage looks each microbatch up in the loop, forward and again backward
        lookup_op = "reduce-scatter" if p.sequence_parallel else "all-reduce"
        add("tensor: the embedding lookups summed over the vocabulary", lookup_op, tp, act, 2 * accum)
        if p.sequence_parallel:
            add("tensor: the lookups' gradients all-gathered", "all-gather", tp, act / n["tensor"], accum)
    elif p.sequence_parallel:
        add("tensor: the embedding table all-gathered", "all-gather", tp, table, accum)
        add("tensor: the embedding's gradient reduced", "all-reduce", tp, table, accum)
    else:
        add("tensor: the embedding lookup all-reduced", "all-reduce", tp, act, accum)
    add("tensor: the head's input gradient all-reduced", "all-reduce", tp, act / head_split, accum)

    # Pipeline: activations go on and gradients come back every iteration (GPipe, circular) or every
    # step of the timetable, idle stages included. GPipe's output leaves split along the sequence
    # over `stage` for the head, and comes back; a timetable's reaches every stage's block of the
    # head inside the loop, and its gradient comes back there.
    split_seq = n["tensor"] if p.sequence_parallel else 1
    if schedule is not None:
        shifts = 2 * (timetable.of(schedule).steps if timetabled else schedule.iterations)
        add("stage: activations shifted on, gradients back", "collective-permute", ("stage",), block / split_seq,
            accum * shifts)  # fmt: skip
    if timetabled:
        add("stage: the output all-reduced to the head", "all-reduce", ("stage",), act / split_seq, accum)
        add("stage: the output's gradient all-reduced", "all-reduce", ("stage",), act / split_seq, accum)
        add("stage: the head's gradient joined", "all-reduce", ("stage",), head, accum)
    elif schedule is not None:
        add("stage: the output reduce-scattered to the head", "reduce-scatter", ("stage",), act / split_seq, accum)
        add("stage: the output's gradient all-gathered", "all-gather", ("stage",), act / split_seq, accum)
        add("stage: the input's gradient all-reduced", "all-reduce", ("stage",), act / split_seq, accum)
        if p.sequence_parallel:  # how XLA lays out the head's sequence here
            logits = rows * t.seq_len * m.padded_vocab / n["tensor"] * 4
            add("stage: the logits' fp32 gradient all-gathered for the head", "all-gather", ("stage",), logits, accum)
    if schedule is not None and p.sequence_parallel and not timetabled:  # how XLA lays out GPipe's lookup here
        lookup = act / (n["tensor"] * stages) * (2 if n["fsdp"] > 1 else 1)  # (and back, under fsdp)
        add("stage: the embedding table and lookup re-laid out", "collective-permute", ("stage",),
            2 * weights["embed"] + lookup, accum)  # fmt: skip

    # Gradients, ZeRO-1, FSDP.
    batch_axes = ("data", "fsdp")
    sharded = p.zero1 or n["fsdp"] > 1  # params or optimizer state split over the data-parallel devices
    if schedule is None:
        grads = every + (share - 1) * qkv
        add(
            f"data+fsdp: gradients {'reduce-scattered' if sharded else 'all-reduced'}",
            "reduce-scatter" if sharded else "all-reduce",
            batch_axes,
            grads,
            accum,
        )
        regathered = (share - 1) * qkv  # a layer's shared QKV, gathered where the layer uses it
        backward = weights["groups"] + regathered * per_layer_remat
        if n["tensor"] > 1 and m.remat == "none":  # the tensor-parallel regions keep their gathered weights
            backward = 0
        gathered = weights["groups"] + backward
        add("fsdp: layer weights all-gathered forward and backward", "all-gather", ("fsdp",), gathered, accum)
    else:
        stage_weights = weights["groups"] / stages
        copies = split(specs["groups"], _itemsize(compute_dtype, norms_in_fp32=True)) / stages
        add("fsdp: the stage's weights all-gathered (compute dtype)", "all-gather", ("fsdp",), copies, 1)
        add("fsdp: the stage's fp32 gradient sums reduce-scattered", "reduce-scatter", ("fsdp",), stage_weights, accum)
        add(
            f"data: the stage's gradient sums {'reduce-scattered' if p.zero1 else 'all-reduced'}",
            "reduce-scatter" if p.zero1 else "all-reduce",
            ("data",),
            stage_weights / n["fsdp"],
            accum,
        )
        add(
            "data+fsdp: embedding, head and final-norm gradients reduced",
            "all-reduce",
            batch_axes,
            every - weights["groups"],
            accum,
        )
        add(
            "stage: each stage's share of the embedding's gradient summed",
            "all-reduce",
            ("stage",),
            weights["embed"] / (n["data"] * n["fsdp"]),
            accum,
        )
    add("fsdp: head, embedding and final norm all-gathered", "all-gather", ("fsdp",), every - weights["groups"], accum)
    if p.zero1:
        updated = (every - weights["groups"] + weights["groups"] / stages) / n["fsdp"]
        add("data: updated params all-gathered (ZeRO-1)", "all-gather", ("data",), updated, 1)
    return out


def by_kind(transfers: list[Transfer]) -> dict[str, float]:
    """Array bytes per step by kind (reduce, gather, permute), as `hlo.collective_bytes` counts."""
    out = {}
    for x in transfers:
        out[x.kind] = out.get(x.kind, 0.0) + x.bytes
    return out
