"""Analytic model maths: parameter counts by component and model FLOPs per token.

`python -m jaxllm.plan --config configs/120b.py` prints them for any config.
"""

from __future__ import annotations

import ml_collections

from jaxllm.config import head_dim, num_kv_heads, padded_vocab
from jaxllm.parallel.pipeline import schedule_of


def param_counts(model: ml_collections.ConfigDict) -> dict[str, int]:
    """Stored parameters by component (no biases; LayerNorm adds one bias per scale)."""
    h, nh, kv, hd, m = model.hidden, model.num_heads, num_kv_heads(model), head_dim(model), model.mlp
    layers, groups, vocab = model.num_layers, model.num_layers // model.qkv_share_every, padded_vocab(model)
    norm = h * (2 if model.norm == "layernorm" else 1)
    ffn_mats = 2 if model.mlp_activation == "gelu" else 3
    counts = {
        "embedding": vocab * h,
        "lm_head": 0 if model.tie_embeddings else h * vocab,
        "qkv (shared per group)": groups * h * (nh + 2 * kv) * hd,
        "attention out": layers * nh * hd * h,
        "feed-forward": layers * ffn_mats * h * m,
        "norms": (2 * layers + 1) * norm,
    }
    counts["total"] = sum(counts.values())
    return counts


def applied_matmul_params(model: ml_collections.ConfigDict) -> int:
    """Weights each token is multiplied by: the shared QKV counts once per layer that applies it,
    and the LM head counts even when tied (the lookup table does not)."""
    h, nh, kv, hd, m = model.hidden, model.num_heads, num_kv_heads(model), head_dim(model), model.mlp
    ffn_mats = 2 if model.mlp_activation == "gelu" else 3
    per_layer = h * (nh + 2 * kv) * hd + nh * hd * h + ffn_mats * h * m
    return model.num_layers * per_layer + h * padded_vocab(model)


def flops_per_token(model: ml_collections.ConfigDict, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward): 6 × applied matmul weights plus
    causal attention, 6·layers·heads·head_dim·seq (half of the full 12·L·H·D·T)."""
    attention = 6 * model.num_layers * model.num_heads * head_dim(model) * seq_len
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

    app.run(lambda argv: print(summary(CONFIG.value)))
