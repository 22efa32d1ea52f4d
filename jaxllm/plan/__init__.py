"""Analytic model maths: parameter counts by component, model FLOPs per token, and per-device
memory by component.

`python -m jaxllm.plan --config configs/120b.py` prints them for any config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections

from jaxllm.config import MESH_AXES, sizes
from jaxllm.model.decoder import param_specs
from jaxllm.model.int8 import int8_model
from jaxllm.model.params import is_norm, is_spec, storage_dtype
from jaxllm.parallel.rules import GATHERED_RULES, OPTIMIZER_RULES, RULES, as_tuple, logical_spec
from jaxllm.parallel.schedule import schedule_of


def param_counts(model: ml_collections.ConfigDict) -> dict[str, int]:
    """Stored parameters by component (no biases; LayerNorm adds one bias per scale)."""
    s, h, nh, m, layers = sizes(model), model.hidden, model.num_heads, model.mlp, model.num_layers
    norm = h * (2 if model.norm == "layernorm" else 1)
    counts = {
        "embedding": s.padded_vocab * h,
        "lm_head": 0 if model.tie_embeddings else h * s.padded_vocab,
        "qkv (shared per group)": s.groups * h * (nh + 2 * s.kv_heads) * s.head_dim,
        "attention out": layers * nh * s.head_dim * h,
        "feed-forward": layers * s.ffn_matrices * h * m,
        "norms": (2 * layers + 1) * norm,
    }
    counts["total"] = sum(counts.values())
    return counts


def applied_matmul_params(model: ml_collections.ConfigDict) -> int:
    """Weights each token is multiplied by: the shared QKV counts once per layer that applies it,
    and the LM head counts even when tied (the lookup table does not)."""
    s, h, nh = sizes(model), model.hidden, model.num_heads
    per_layer = h * (nh + 2 * s.kv_heads) * s.head_dim + nh * s.head_dim * h + s.ffn_matrices * h * model.mlp
    return model.num_layers * per_layer + h * s.padded_vocab


def flops_per_token(model: ml_collections.ConfigDict, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward): 6 × applied matmul weights plus
    causal attention, 6·layers·heads·head_dim·seq (half of the full 12·L·H·D·T)."""
    attention = 6 * model.num_layers * model.num_heads * sizes(model).head_dim * seq_len
    return 6 * applied_matmul_params(model) + attention


def _itemsize(dtype, norms_in_fp32: bool = False) -> Callable[[tuple], int]:
    """A leaf's bytes per element by its path (the pipeline keeps norm scales in fp32)."""
    size = jnp.dtype(dtype).itemsize
    return lambda path: 4 if norms_in_fp32 and is_norm(path) else size


def _per_device_bytes(specs, rules, mesh: jax.sharding.AbstractMesh, itemsize, *, fit: bool = False) -> int:
    """Bytes one device holds of `specs` laid out by `rules` (see `logical_spec` for `fit`)."""

    def one(path, spec):
        pspec = tuple(logical_spec(spec.axes, rules, spec.shape if fit else None, mesh if fit else None))
        entries = pspec + (None,) * (len(spec.shape) - len(pspec))
        splits = [math.prod(mesh.shape[a] for a in as_tuple(e)) for e in entries]
        return math.prod(-(-d // n) for d, n in zip(spec.shape, splits, strict=True)) * itemsize(path)

    return sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)))


def _stash_per_token(model: ml_collections.ConfigDict, seq: int, tensor: int, sp: bool) -> tuple[float, float]:
    """Bytes per token on one device of one layer's activations: (what its remat policy keeps for
    the backward pass, all of them)."""
    s, a = sizes(model), jnp.dtype(model.dtype).itemsize
    residual = model.hidden * a / (tensor if sp else 1)  # the residual stream between blocks
    block = model.hidden * a  # a block's gathered input, and its partial output before the sum
    q, kv = model.num_heads // tensor * s.head_dim * a, s.kv_heads // tensor * s.head_dim * a
    mlp = model.mlp // tensor * a
    scores = model.num_heads // tensor * seq * (4 + a) if model.attention == "xla" else 0  # fp32 and probs
    dots = (q + 2 * kv) + scores + q + block + (s.ffn_matrices - 1) * mlp + block
    everything = dots + 2 * block + mlp + 2 * residual  # + norm outputs, GLU product, residual sums
    kept = {
        "none": everything,
        "full": residual,
        "group": residual / model.qkv_share_every,
        "selective": residual + (q + 2 * kv) + q + mlp + residual,  # decoder.SAVED_NAMES
        "dots": dots,
        "offload": 0.0,  # kept in host memory
    }
    return kept[model.remat], everything


def memory(cfg: ml_collections.ConfigDict) -> dict[str, float]:
    """Per-device bytes of a training step by component, from the config alone (mesh sizes of -1
    count as 1). What the planner predicts and `--dry-run` prints beside the compiler's figures.
    An offloaded optimizer state is counted apart from the device total."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    mesh_sizes = {a: max(p[a], 1) for a in MESH_AXES}
    mesh = jax.sharding.AbstractMesh(tuple(mesh_sizes.values()), MESH_AXES)
    schedule = schedule_of(cfg)
    specs = param_specs(m, schedule)
    fp32, param = _itemsize(jnp.float32), _itemsize(m.param_dtype)
    compute = _itemsize(m.dtype, norms_in_fp32=True)
    moment_rules = OPTIMIZER_RULES if p.zero1 else RULES
    moments = 2 * _per_device_bytes(specs, moment_rules, mesh, fp32, fit=True)
    out = {
        "params": _per_device_bytes(specs, RULES, mesh, param),
        "optimizer state (Adam m, v)": 0.0 if p.offload_optimizer else moments,
        "fp32 gradients": _per_device_bytes(specs, RULES, mesh, fp32) * (2 if t.grad_accum_steps > 1 else 1),
    }
    groups = specs["groups"]
    if schedule is None:  # FSDP gathers one group at a time; its gradient is summed before the scatter
        one_group = jax.tree.map(
            lambda s: dataclasses.replace(s, shape=s.shape[1:], axes=s.axes[1:]), groups, is_leaf=is_spec
        )
        gathered = _per_device_bytes(one_group, GATHERED_RULES, mesh, compute)
        gathered += _per_device_bytes(one_group, GATHERED_RULES, mesh, fp32)
    else:  # the stage's weights for the whole step, and their fp32 gradient sums (see pipeline.py)
        gathered = _per_device_bytes(groups, GATHERED_RULES, mesh, compute)
        gathered += _per_device_bytes(groups, GATHERED_RULES, mesh, fp32)
    out["gathered weights + their fp32 gradient"] = gathered
    data, tensor, stage = mesh_sizes["data"] * mesh_sizes["fsdp"], mesh_sizes["tensor"], mesh_sizes["stage"]
    rows = t.batch_size // data // t.grad_accum_steps  # sequences per device per microstep
    stash, whole_layer = _stash_per_token(m, t.seq_len, tensor, p.sequence_parallel)
    # The backward pass rebuilds a shared-QKV group's layers together (one iteration of the scan
    # over groups), each with its gradient: the largest transient besides the logits.
    rebuilt = 2 * m.qkv_share_every * whole_layer
    residual = m.hidden * jnp.dtype(m.dtype).itemsize / (tensor if p.sequence_parallel else 1)
    if schedule is None:
        tokens = rows * t.seq_len
        out[f"activations (remat {m.remat})"] = m.num_layers * tokens * stash
    else:  # each iteration's input and output are kept; one iteration's stage is rebuilt at a time
        tokens = rows // schedule.microbatches * t.seq_len
        stage_layers = m.num_layers // (stage * schedule.repeats)
        kept = 2 * schedule.iterations * tokens * residual
        out[f"activations (remat {m.remat})"] = kept + stage_layers * tokens * stash
    head_tokens = rows * t.seq_len // (stage if schedule else 1)
    logits = head_tokens * sizes(m).padded_vocab // tensor * 4 * 2  # fp32 logits and their gradient
    out["temporaries (a group rebuilt; logits)"] = max(tokens * rebuilt, logits)
    out["total"] = sum(out.values())
    if p.offload_optimizer:
        out["optimizer state in host memory"] = moments
    return out


WEIGHT_BYTES = {"bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def weight_bytes(model: ml_collections.ConfigDict) -> dict[str, float]:
    """The weights' bytes at each width (every parameter), and as `--quantize int8` serves them:
    dense projections int8 with fp32 scales, the embedding, head and norms in bf16."""
    total = param_counts(model)["total"]
    out = {width: total * size for width, size in WEIGHT_BYTES.items()}
    specs = jax.tree.leaves(param_specs(int8_model(model)), is_leaf=is_spec)
    out["int8 as served"] = sum(math.prod(s.shape) * storage_dtype(s, jnp.bfloat16).itemsize for s in specs)
    return out


def memory_table(planned: dict[str, float]) -> list[str]:
    unit, scale = ("GiB", 2**30) if planned["total"] >= 2**30 else ("MiB", 2**20)
    return [f"  {name:<42}{n / scale:10.2f} {unit}" for name, n in planned.items()]


def summary(cfg: ml_collections.ConfigDict) -> str:
    model, seq = cfg.model, cfg.train.seq_len
    lines = ["parameters:"]
    lines += [f"  {name:<24}{n:>20,}" for name, n in param_counts(model).items()]
    lines.append(f"applied matmul params/token {applied_matmul_params(model):,}")
    lines.append(f"training FLOPs/token        {flops_per_token(model, seq):.4g} (seq {seq})")
    lines.append(f"training FLOPs/step         {flops_per_token(model, seq) * cfg.train.batch_size * seq:.4g}")
    precision = f"precision: params {model.param_dtype}, compute {model.dtype}"
    if model.fp8.enabled:
        fp8 = f"e4m3 forward, e5m2 gradients, current scaling, amax {model.fp8.amax_reduce}"
        precision += f"; dense projections FP8 ({fp8})"
    lines.append(precision)
    widths = ", ".join(f"{width} {n / 1e9:.4g}" for width, n in weight_bytes(model).items())
    lines.append(f"weights, GB: {widths}")
    if (schedule := schedule_of(cfg)) is not None:
        lines.append(
            f"pipeline: {schedule.stages} stages × {schedule.repeats} repeats, {schedule.microbatches} microbatches, "
            f"{schedule.iterations} iterations, bubble {schedule.bubble:.1%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    from absl import app

    from jaxllm.cli import CONFIG
    from jaxllm.errors import exit_on_error

    def main(argv) -> None:
        cfg = CONFIG.value
        print(summary(cfg))
        print("per-device memory of a train step (mesh sizes of -1 count as 1):")
        print("\n".join(memory_table(memory(cfg))))

    app.run(exit_on_error(main))
