"""Optimizer: clip by global norm → AdamW (weight decay where a parameter's policy asks for it: not
on norms), linear warmup + cosine decay."""

from __future__ import annotations

import jax
import optax

from jaxllm.config import TrainConfig
from jaxllm.model.params import is_spec


def learning_rate(train: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.lr,
        warmup_steps=train.warmup_steps,
        decay_steps=max(train.steps, train.warmup_steps + 1),
        end_value=train.lr * train.min_lr_ratio,
    )


def make_optimizer(train: TrainConfig, specs: dict) -> optax.GradientTransformation:
    """The optimizer of parameters declared as `specs` (each `ParamSpec`'s `decay` says whether
    weight decay applies to it)."""
    return optax.chain(
        optax.clip_by_global_norm(train.clip_norm),
        optax.adamw(
            learning_rate(train),
            b1=train.b1,
            b2=train.b2,
            eps=train.eps,
            weight_decay=train.weight_decay,
            mask=jax.tree.map(lambda s: s.decay, specs, is_leaf=is_spec),
        ),
    )
