"""The one custom VJP behind the dense projections (`dense.py`), plain or FP8 (`fp8.py`): `x`
projected by several weights through an einsum `spec`, in x's (compute) dtype, each weight's
gradient returned in fp32 by its own dot (Megatron's gradient-accumulation fusion).

A weight comes in as the fp32 parameter itself, cast to the compute dtype inside the op, or as a
pipeline's `Copy` (the loop's compute-dtype copy and the fp32 sink its gradient goes to). Either
way the weight-gradient dot's fp32 result is what lands on an fp32 primal and is added to the sum
over microbatches (pipeline iterations, accumulation microsteps): never rounded to the compute
dtype first, as the VJP of a cast after a bf16 dot would."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.parallel.pipeline import Copy


class Plain(NamedTuple):
    """Operands enter the dots as they are, in the compute dtype, each dot at the default precision.
    (`fp8.Fp8` is the other encoding: scaled fp8 operands.)"""

    forward_precision: None = None
    grad_precision: None = None

    def input(self, x: jax.Array) -> jax.Array:
        return x

    weight = grad = input


def _dense(operand, dtype) -> jax.Array:
    """An encoded operand as an array in `dtype` (an fp8 one dequantized, exactly)."""
    return operand.dequantized(dtype) if hasattr(operand, "dequantized") else operand


def _dot(spec: str, a, b, dtype, precision, out=None) -> jax.Array:
    return jnp.einsum(spec, _dense(a, dtype), _dense(b, dtype), precision=precision, preferred_element_type=out)


def projections(encoding) -> Callable:
    """The projection op with operands in `encoding` (`Plain()` or an `fp8.Fp8`)."""

    def project(x: jax.Array, weights: tuple, spec: str) -> tuple[jax.Array, ...]:
        targets = tuple(None if isinstance(w, Copy) else jnp.dtype(w.dtype).name for w in weights)
        return _project(x, tuple(weights), spec, encoding, targets)

    return project


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _project(x, weights, spec, encoding, targets):
    return _forward(x, weights, spec, encoding, targets)[0]


def _forward(x, weights, spec, encoding, targets):
    values = tuple((w.values if isinstance(w, Copy) else w).astype(x.dtype) for w in weights)
    ex, ews = encoding.input(x), tuple(map(encoding.weight, values))
    outs = tuple(_dot(spec, ex, ew, x.dtype, encoding.forward_precision) for ew in ews)
    return outs, (ex, ews)  # FP8 keeps its fp8 operands for the backward pass: 1 byte per element


def _backward(spec, encoding, targets, residuals, grads):
    """dx = Σ g·wᵀ in the compute dtype and dw = xᵀ·g in fp32, with each g encoded once; dw goes
    to the fp32 parameter (in its own dtype) or to a pipeline copy's sink."""
    (ex, ews), dtype = residuals, grads[0].dtype
    (x_dims, w_dims), y_dims = spec.split("->")[0].split(","), spec.split("->")[1]
    dx, dws = None, []
    for ew, g, target in zip(ews, grads, targets, strict=True):
        eg, precision = encoding.grad(g), encoding.grad_precision
        term = _dot(f"{y_dims},{w_dims}->{x_dims}", eg, ew, dtype, precision)
        dx = term if dx is None else dx + term
        dw = _dot(f"{x_dims},{y_dims}->{w_dims}", ex, eg, dtype, precision, out=jnp.float32)
        dws.append(Copy(None, dw) if target is None else dw.astype(target))
    return dx, tuple(dws)


_project.defvjp(_forward, _backward)
