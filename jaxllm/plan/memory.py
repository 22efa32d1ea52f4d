"""Bytes per device: a training step's by component under the configured layout, one layer's
activations by remat policy (Korthikanti et al. 2022's formula beside them), and a serving KV cache."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxllm.config import MESH_AXES, TABLE_SCHEDULES, ModelConfig, RunConfig, Schedule
from jaxllm.model.decoder import Model
from jaxllm.model.lora import partition, trained_mask
from jaxllm.model.params import ParamSpec, is_spec, storage_dtype
from jaxllm.parallel import timetable
from jaxllm.parallel.rules import GATHERED_RULES, OPTIMIZER_RULES, RULES, as_tuple, logical_spec


def mesh_sizes(cfg: RunConfig) -> dict[str, int]:
    """The mesh the planner assumes: each size as configured, -1 counted as 1."""
    return {a: max(s, 1) for a, s in cfg.parallel.sizes.items()}


@functools.lru_cache(maxsize=64)
def specs_of(model: ModelConfig, schedule: Schedule | None = None) -> dict:
    """The model's parameter specs, remembered: a layout search asks for the same model's many times."""
    return Model(model, schedule).specs


def _itemsize(dtype, norms_in_fp32: bool = False) -> Callable[[ParamSpec], int]:
    """A parameter's bytes per element in `dtype` or its own (LoRA's fp32 adapters); the pipeline's
    copies keep the `keep_fp32` ones in fp32."""
    return lambda spec: 4 if norms_in_fp32 and spec.keep_fp32 else storage_dtype(spec, dtype).itemsize


def _per_device_bytes(specs, rules, mesh: jax.sharding.AbstractMesh, itemsize, *, fit: bool = False) -> int:
    """Bytes one device holds of `specs` laid out by `rules` (see `logical_spec` for `fit`)."""
    rules = tuple(rules.items())
    return sum(_elements_per_device(s.shape, s.axes, rules, mesh, fit) * itemsize(s)
               for s in jax.tree.leaves(specs, is_leaf=is_spec))  # fmt: skip


@functools.cache
def _elements_per_device(shape, axes, rules, mesh: jax.sharding.AbstractMesh, fit: bool) -> int:
    """One parameter's elements on one device; kept, as the planner's search asks the same of
    thousands of layouts."""
    pspec = tuple(logical_spec(axes, dict(rules), shape if fit else None, mesh if fit else None))
    entries = pspec + (None,) * (len(shape) - len(pspec))
    splits = [math.prod(mesh.shape[a] for a in as_tuple(e)) for e in entries]
    return math.prod(-(-d // n) for d, n in zip(shape, splits, strict=True))


def _stash_per_token(model: ModelConfig, seq: int, tensor: int, sp: bool) -> tuple[dict, float, float]:
    """Bytes per token on one device of one layer's activations: (what each remat policy keeps
    on the device for the backward pass, what the backward pass holds while it rebuilds the layer
    and takes its gradient, what a split backward hands its weight gradients: each projection's
    input and output gradient, each norm's normalised input and output gradient). The tensors are
    those the layer tags for its policies (`decoder.SAVED_NAMES`, the dots' outputs);
    `tests/unit/test_memory_plan.py` checks them against the compiler's memory analysis under every policy."""
    s, a = model, jnp.dtype(model.dtype).itemsize
    residual = model.hidden * a / (tensor if sp else 1)  # the residual stream between blocks
    block = model.hidden * a  # a block's gathered input, and its partial output before the sum
    q, kv = model.num_heads // tensor * s.head_dim * a, s.num_kv_heads // tensor * s.head_dim * a
    mlp = model.mlp // tensor * a
    # XLA attention's [heads, seq] per token: the QK dot's fp32 output (what `dots` keeps); for the
    # backward of the mask and the softmax, the masked fp32 scores, the fp32 softmax and its copy
    # in the compute dtype. A fused kernel keeps none of them.
    scores = model.num_heads // tensor * seq if model.attention == "xla" else 0
    projections = (q + 2 * kv) + q + block + (s.ffn_matrices - 1) * mlp + block  # the other dots' outputs
    others = 2 * block + mlp + 2 * residual  # norm outputs, GLU product, residual sums
    kept = {
        "none": projections + (8 + a) * scores + others,
        "full": residual,
        "group": residual / model.qkv_share_every,
        "selective": residual + (q + 2 * kv) + q + mlp + residual,  # decoder.SAVED_NAMES
        "dots": projections + 4 * scores,
        "offload": 0.0,  # SAVED_NAMES, in host memory
    }
    # Rebuilt and differentiated, in fp32 on XLA:CPU (no bf16 arithmetic): every token-sized tensor
    # at 4 bytes, and about REBUILT_SCORES fp32 [heads, seq] arrays at once (the scores, the softmax
    # and their gradients, not all live together), as the test layouts and configs/1b.py, 8b.py
    # measure.
    rebuilt = (projections + others) * 4 / a + REBUILT_SCORES * 4 * scores
    taps = projections + (2 * block + q + mlp) + 2 * (residual * 4 / a + block)  # each norm: its fp32 x̂, its gathered g
    return kept, rebuilt, taps


REBUILT_SCORES = 2.5


def memory(cfg: RunConfig) -> dict[str, float]:
    """Per-device bytes of a training step by component, from the config alone (mesh sizes of -1
    count as 1). What the planner predicts and `--dry-run` prints beside the compiler's figures.
    An offloaded optimizer state, and the activations remat 'offload' moves, are counted apart
    from the device total. With LoRA, gradients and optimizer state are the adapters' alone."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    sizes = mesh_sizes(cfg)
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), MESH_AXES)
    schedule = cfg.parallel.pipeline
    specs = specs_of(m, schedule)
    trained = partition(specs, trained_mask(specs, m))[0]
    fp32, param = _itemsize(jnp.float32), _itemsize(m.param_dtype)
    compute = _itemsize(m.dtype, norms_in_fp32=True)
    moment_rules = OPTIMIZER_RULES if p.zero1 else RULES
    moments = 2 * _per_device_bytes(trained, moment_rules, mesh, fp32, fit=True)
    out = {
        "params": _per_device_bytes(specs, RULES, mesh, param),
        "optimizer state (Adam m, v)": 0.0 if p.offload_optimizer else moments,
        # summed where they lie as the moments do (split over data too with zero1); with
        # accumulation, a microstep's beside their sum
        "fp32 gradients": moments / 2 * (2 if t.grad_accum_steps > 1 else 1),
    }
    groups, trained_groups = specs["groups"], trained.get("groups", {})
    if schedule is None:  # FSDP gathers one group at a time; its gradient is summed before the scatter
        def one_group(tree):
            return jax.tree.map(lambda s: dataclasses.replace(s, shape=s.shape[1:], axes=s.axes[1:]), tree,
                                is_leaf=is_spec)  # fmt: skip

        gathered = _per_device_bytes(one_group(groups), GATHERED_RULES, mesh, compute)
        gathered += _per_device_bytes(one_group(trained_groups), GATHERED_RULES, mesh, fp32)
    else:  # the stage's weights for the whole step, and their fp32 gradient sums (see pipeline.py)
        gathered = _per_device_bytes(groups, GATHERED_RULES, mesh, compute)
        gathered += _per_device_bytes(trained_groups, GATHERED_RULES, mesh, fp32)
    table = schedule is not None and schedule.kind in TABLE_SCHEDULES
    if table:  # the head runs inside the loop, its vocabulary split over stage × tensor, and the embedding,
        # split over tensor, each with an fp32 gradient sum
        gathered += 2 * m.hidden * m.padded_vocab * (1 / (sizes["tensor"] * sizes["stage"]) + 1 / sizes["tensor"]) * 4
    out["gathered weights + their fp32 gradient"] = gathered
    data, tensor, stage = sizes["data"] * sizes["fsdp"], sizes["tensor"], sizes["stage"]
    rows = t.batch_size // data // t.grad_accum_steps  # sequences per device per microstep
    kept, rebuilt, taps = _stash_per_token(m, t.seq_len, tensor, p.sequence_parallel)
    stash = kept[m.remat]
    residual = m.hidden * jnp.dtype(m.dtype).itemsize / (tensor if p.sequence_parallel else 1)
    if schedule is None:
        tokens, layers = rows * t.seq_len, m.num_layers
    else:
        tokens, layers = rows // schedule.microbatches * t.seq_len, m.num_layers // (stage * schedule.repeats)
    if table:  # the timetable's buffers (the stashed inputs twice: XLA keeps a buffer that a step
        # reads before it writes it twice), a unit's forward and backward in flight, and the first
        # stage's fp32 rows looked up for the microbatch it embeds; one unit's chunk rebuilt at a
        # time, as GPipe's stage
        slots = timetable.of(schedule)
        edges = (2 * (slots.x_slots + 1) + slots.g_slots + 4) * tokens * residual + tokens * m.hidden * 4
        if slots.split:  # the split schedules: held units' residuals (what the remat policy keeps) and put-off
            # units' taps, each buffer with its scratch slot and the one the loop writes next step
            edges += ((slots.r_slots + 2) * stash + (slots.w_slots + 2) * taps) * layers * tokens
    else:  # a GPipe loop keeps each iteration's input and output
        edges = 2 * schedule.iterations * tokens * residual if schedule else 0.0
    # A pipeline's backward rebuilds one iteration's layers; when those are a single group, its
    # rebuilt internals (below) are all it holds, whatever the remat policy.
    stashed = 0 if schedule and layers <= m.qkv_share_every else layers
    out[f"activations (remat {m.remat})"] = edges + stashed * tokens * stash
    if table:  # one microbatch's logits on every stage, the whole sequence on a block of the vocabulary
        logits = tokens * m.padded_vocab // (tensor * stage) * 4 * 2
    else:  # fp32 logits and their gradient, each stage on its slice of the sequence
        logits = rows * t.seq_len // (stage if schedule else 1) * m.padded_vocab // tensor * 4 * 2
    # The backward pass rebuilds a shared-QKV group's layers together (one iteration of the scan
    # over groups) and takes their gradients, while the logits and their gradient are still held.
    out["temporaries (a group rebuilt, logits)"] = tokens * m.qkv_share_every * rebuilt + logits
    out["total"] = sum(out.values())
    if p.offload_optimizer:
        out["optimizer state in host memory"] = moments
    if m.remat == "offload":
        out["activations in host memory (remat offload)"] = stashed * tokens * kept["selective"]
    return out


def memory_table(planned: dict[str, float]) -> list[str]:
    unit, scale = ("GiB", 2**30) if planned["total"] >= 2**30 else ("MiB", 2**20)
    return [f"  {name:<42}{n / scale:10.2f} {unit}" for name, n in planned.items()]


KV_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "int8": 1}
KV_SCALE_BYTES = {"int8": 4}  # one fp32 scale per token, head and K or V (see model/cache.py)


def kv_cache_bytes(model: ModelConfig, batch: int, context: int, dtype: str, tensor: int = 1) -> float:
    """Bytes per device of a KV cache for `batch` sequences of `context` tokens: one key and one
    value per layer, token and kv head (split over `tensor`), plus int8's scales."""
    s = model
    per_head = s.head_dim * KV_BYTES[dtype] + KV_SCALE_BYTES.get(dtype, 0)
    return 2 * model.num_layers * batch * context * s.num_kv_heads / tensor * per_head


def korthikanti_layer_bytes(model: ModelConfig, seq: int, batch: int) -> float:
    """Korthikanti et al. 2022's activations of one layer, no parallelism or recompute, 16-bit:
    s·b·h·(34 + 5·a·s/h) bytes (GELU MLP 4h, dropout masks, attention scores stored)."""
    h = model.hidden
    return seq * batch * h * (34 + 5 * model.num_heads * seq / h)


def layer_activation_bytes(
    model: ModelConfig, seq: int, batch: int, tensor: int = 1, sequence_parallel: bool = False
) -> dict[str, float]:
    """One layer's activations kept for the backward pass, per device, by remat policy."""
    kept, *_ = _stash_per_token(model, seq, tensor, sequence_parallel)
    return {policy: n * seq * batch for policy, n in kept.items()}
