"""Optimizer: clip by global norm → AdamW (no decay on norms), linear warmup + cosine decay."""

from __future__ import annotations

import jax
import optax

from jaxllm.config import TrainConfig
from jaxllm.model.params import is_norm


def learning_rate(train: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.lr,
        warmup_steps=train.warmup_steps,
        decay_steps=max(train.steps, train.warmup_steps + 1),
        end_value=train.lr * train.min_lr_ratio,
    )


def _decays(params) -> dict:
    """Weight decay applies to matrices, not to norm scales and biases."""
    return jax.tree_util.tree_map_with_path(lambda path, _: not is_norm(path), params)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(train.clip_norm),
        optax.adamw(
            learning_rate(train),
            b1=train.b1,
            b2=train.b2,
            eps=train.eps,
            weight_decay=train.weight_decay,
            mask=_decays,
        ),
    )
