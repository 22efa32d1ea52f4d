"""The one op every dense projection (q, k, v, o_proj, gate, up, down) goes through: `x` projected
by each of several weights through an einsum `spec` (e.g. "bte,ehd->bthd"), in x's dtype. The
default is plain einsums; `model.fp8.enabled` swaps in FP8 (`fp8.py`). Attention scores, the PV
product, the embedding and the LM head stay in the compute dtype."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxllm.model.fp8 import fp8_projections

Project = Callable[[jax.Array, tuple[jax.Array, ...], str], tuple[jax.Array, ...]]


def einsum_projections(x: jax.Array, weights: tuple[jax.Array, ...], spec: str) -> tuple[jax.Array, ...]:
    """Einsums in x's (compute) dtype, the weights cast to it."""
    return tuple(jnp.einsum(spec, x, w.astype(x.dtype)) for w in weights)


def projections(fp8) -> Project:
    """The op a model's `fp8` settings ask for."""
    return fp8_projections(fp8.amax_reduce) if fp8.enabled else einsum_projections
