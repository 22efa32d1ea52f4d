"""How checkpoints lay out a run's state: layer groups in the canonical, mesh-independent order
(so a checkpoint restores onto any layout, pipeline or not), and the model fields that decide
whether saved parameters fit a config."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxllm.config import ConfigError, ModelConfig, Schedule
from jaxllm.parallel.schedule import canonical_view, pipeline_view


def _map_groups(fn, tree):
    """Applies `fn` to every subtree stored under a 'groups' key: the params and their moments."""
    if isinstance(tree, dict):
        return {k: fn(v) if k == "groups" else _map_groups(fn, v) for k, v in tree.items()}
    if hasattr(tree, "_fields"):  # optax states are NamedTuples
        return type(tree)(*(_map_groups(fn, v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_groups(fn, v) for v in tree)
    return tree


def to_canonical(tree: Any, schedule: Schedule | None) -> Any:
    """Layer groups in canonical order (a free reshape; identity without a pipeline)."""
    return tree if schedule is None else _map_groups(canonical_view, tree)


def from_canonical(tree: Any, schedule: Schedule | None) -> Any:
    return tree if schedule is None else _map_groups(partial(pipeline_view, schedule=schedule), tree)


def _model_fields(model: ModelConfig) -> dict:
    """What makes parameters compatible: the model's shape (not dtype or remat); head_dim and
    num_kv_heads are resolved, so an explicit one equal to its default is the same shape."""
    keep = ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "mlp", "vocab_size",
            "vocab_pad_multiple", "qkv_share_every", "norm", "mlp_activation", "tie_embeddings")  # fmt: skip
    return {k: getattr(model, k) for k in keep}


def check_same_shape(saved: ModelConfig, model: ModelConfig, where: str) -> None:
    """Refuses parameters saved for another model shape, naming the fields that differ."""
    have, want = _model_fields(saved), _model_fields(model)
    if have != want:
        changed = {k: (v, want[k]) for k, v in have.items() if want[k] != v}
        raise ConfigError(
            f"{where} is for another model shape (saved vs configured: {changed}); "
            "use a new --workdir or the original model settings"
        )
