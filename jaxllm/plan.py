"""Analytic model maths: parameter counts by component and model FLOPs per token.

`python -m jaxllm.plan --config configs/120b.py` prints them for any config.
"""

from __future__ import annotations

import ml_collections

from jaxllm.config import sizes
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


def summary(cfg: ml_collections.ConfigDict) -> str:
    model, seq = cfg.model, cfg.train.seq_len
    lines = ["parameters:"]
    lines += [f"  {name:<24}{n:>20,}" for name, n in param_counts(model).items()]
    lines.append(f"applied matmul params/token {applied_matmul_params(model):,}")
    lines.append(f"training FLOPs/token        {flops_per_token(model, seq):.4g} (seq {seq})")
    lines.append(f"training FLOPs/step         {flops_per_token(model, seq) * cfg.train.batch_size * seq:.4g}")
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

    app.run(exit_on_error(lambda argv: print(summary(CONFIG.value))))
