"""The one table that maps logical axis names to mesh axes.

Model code names its dimensions (`embed`, `heads`, `batch`, ...); only this table knows the mesh.
Changing a layout means changing this table or the mesh sizes, never the model. A run whose
activations follow another table (sequence parallelism) enters it with `activation_rules` while its
step traces.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

RULES: dict[str, MeshAxes] = {
    # activations
    "batch": ("data", "fsdp"),
    "seq": None,
    "act_seq": None,  # the residual stream's sequence between blocks: "tensor" with sequence parallelism
    "act_embed": None,  # the residual stream stays whole on each device
    # parameters (and activations that carry these dims)
    "embed": "fsdp",  # ZeRO-3: parameters sharded on their model dim
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "repeats": None,
    "sublayers": None,
    "lora_rank": None,  # a LoRA adapter's rank: small, whole on every device
    "stages": "stage",  # the pipeline view's stage dim
    "head_seq": "stage",  # after a pipeline, the head and loss split the sequence over its stages
}

# The same table as (logical, mesh axes) pairs, for Flax: `with nnx.logical_axis_rules(AXIS_RULES): ...`.
AXIS_RULES: tuple[tuple[str, MeshAxes], ...] = tuple(RULES.items())

# Megatron's sequence parallelism: between tensor-parallel blocks, the residual stream (and the
# norms on it) is split over `tensor` along the sequence.
SEQUENCE_PARALLEL_RULES: dict[str, MeshAxes] = {**RULES, "act_seq": "tensor"}

_ACTIVE: contextvars.ContextVar[Mapping[str, MeshAxes]] = contextvars.ContextVar("axis_rules", default=RULES)


def rules_for(parallel) -> Mapping[str, MeshAxes]:
    """The activation rules of a run's `parallel` settings."""
    return SEQUENCE_PARALLEL_RULES if parallel.sequence_parallel else RULES


@contextlib.contextmanager
def activation_rules(rules: Mapping[str, MeshAxes]) -> Iterator[None]:
    """Activations traced inside follow `rules` (see `constrain`); a step enters it as it traces."""
    token = _ACTIVE.set(rules)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> Mapping[str, MeshAxes]:
    return _ACTIVE.get()


def sequence_parallel() -> bool:
    """Whether the residual stream being traced is split over `tensor` along the sequence."""
    return "tensor" in as_tuple(active_rules()["act_seq"])


# A pipeline stage's weights inside its loop: gathered whole on the FSDP dim.
GATHERED_RULES: dict[str, MeshAxes] = {**RULES, "embed": None}

# ZeRO-1: optimizer state is also split over the data-parallel replicas.
OPTIMIZER_RULES: dict[str, MeshAxes] = {**RULES, "embed": ("fsdp", "data")}


def is_axes(x) -> bool:
    """A leaf of a tree of logical axis names: one array's names, as a tuple of names and Nones."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_spec(
    names: Sequence[str | None],
    rules: Mapping[str, MeshAxes] = RULES,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """PartitionSpec for logical dim names. With `shape` and `mesh`, mesh axes that do not divide
    a dim are left out (used for ZeRO-1, whose extra data split is an optimisation, not a must)."""
    out = []
    for i, name in enumerate(names):
        axes = as_tuple(rules[name]) if name is not None else ()
        if shape is not None and mesh is not None:
            kept, size = [], 1
            for a in axes:
                if shape[i] % (size * mesh.shape[a]) == 0:
                    kept.append(a)
                    size *= mesh.shape[a]
            axes = tuple(kept)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def constrain(x: jax.Array, *names: str | None, rules: Mapping[str, MeshAxes] | None = None) -> jax.Array:
    """Pins an array's sharding by logical names (under the active rules unless `rules` is given);
    without a mesh in context (a notebook, one device), or inside a region manual over every mesh
    axis (the pipeline), there is nothing to pin."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.manual_axes) == set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(names, rules or active_rules()))


def tree_shardings(specs, mesh: Mesh, rules: Mapping[str, MeshAxes] = RULES, *, fit: bool = False):
    """NamedShardings for a tree of specs (objects with `.axes` and `.shape`).
    `fit=True` drops mesh axes that do not divide a dim (see `logical_spec`)."""

    def one(spec):
        return NamedSharding(mesh, logical_spec(spec.axes, rules, spec.shape if fit else None, mesh if fit else None))

    return jax.tree.map(one, specs, is_leaf=lambda x: hasattr(x, "axes") and hasattr(x, "shape"))


def manual_spec(
    *names: str | None, manual_axes: frozenset[str] = frozenset({"tensor"}), rules: Mapping[str, MeshAxes] = RULES
) -> PartitionSpec:
    """The part of a logical spec that a `shard_map` over `manual_axes` handles by hand; the other
    mesh axes stay automatic (GSPMD)."""
    dims = []
    for name in names:
        kept = tuple(a for a in as_tuple(rules[name] if name else None) if a in manual_axes)
        dims.append(kept[0] if len(kept) == 1 else (kept or None))
    return PartitionSpec(*dims)
