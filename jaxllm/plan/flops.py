"""Model FLOPs: ours (causal attention counted once) and Megatron-LM's convention beside it."""

from __future__ import annotations

from jaxllm.config import SPLIT_SCHEDULES, ModelConfig, RunConfig
from jaxllm.plan.params import applied_matmul_params, lora_count


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Training FLOPs of causal attention per token: scores and weighted values, forward and
    backward, over the half of the sequence a causal token sees: 6·layers·heads·head_dim·seq."""
    return 6 * model.num_layers * model.num_heads * model.head_dim * seq_len


def weight_flops_per_token(model: ModelConfig) -> float:
    """Matmul FLOPs of one training token: 6 × applied weights (forward, input and weight
    gradients); with LoRA, 4 × for the frozen weights (no weight gradient) and 6 × the adapters'."""
    if model.lora.rank:
        return 4 * applied_matmul_params(model) + 6 * lora_count(model, applied=True)
    return 6 * applied_matmul_params(model)


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward): the weights' (see
    `weight_flops_per_token`) plus causal attention (see `attention_flops_per_token`)."""
    return weight_flops_per_token(model) + attention_flops_per_token(model, seq_len)


def megatron_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Megatron-LM's convention (Narayanan et al. 2021): the same weights, attention as 12·l·h·s,
    every score computed (no causal half), with h = heads × head_dim."""
    return weight_flops_per_token(model) + 12 * model.num_layers * model.num_heads * model.head_dim * seq_len


def recomputed_flops_per_token(cfg: RunConfig) -> float:
    """Forward FLOPs run again in the backward pass: one forward under every remat policy that
    rebuilds whole layers (none for `none`; the attention core for `selective`, `dots` and
    `offload`), plus one more forward of every stage in a pipeline, which rebuilds each
    iteration's stage (not a split schedule's, whose forward keeps what the policy keeps)."""
    model, seq = cfg.model, cfg.train.seq_len
    attention_core = attention_flops_per_token(model, seq) / 3
    forward = 2 * (applied_matmul_params(model) + lora_count(model, applied=True)) + attention_core
    policy = {
        "none": 0.0,
        "full": forward,
        "group": forward,
        "selective": attention_core,
        "dots": attention_core,
        "offload": attention_core,
    }[model.remat]
    rebuilt = cfg.parallel.stage > 1 and cfg.parallel.schedule not in SPLIT_SCHEDULES
    return policy + (forward if rebuilt else 0.0)
