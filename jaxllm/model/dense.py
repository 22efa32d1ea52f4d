"""The dense projections (q, k, v, o_proj, gate, up, down): their weights' declaration and the one
op they all go through, `x` projected by each of several weights through an einsum `spec` (e.g.
"bte,ehd->bthd"), in x's dtype, each weight's gradient in fp32 from its dot (`project.py`). The
default is plain einsums; `model.fp8.enabled` swaps in FP8 (`fp8.py`) and `model.quantize="int8"`
int8 weights (`int8.py`, serving, no gradients). Attention scores, the PV
product, the embedding and the LM head stay in the compute dtype."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.fp8 import fp8_projections
from jaxllm.model.int8 import Int8Weight, int8_projections
from jaxllm.model.lora import with_adapters
from jaxllm.model.params import declare
from jaxllm.model.project import Plain
from jaxllm.model.project import projections as projections_with

Project = Callable[[jax.Array, tuple[jax.Array, ...], str], tuple[jax.Array, ...]]


def dense_weight(
    model: ModelConfig,
    stack: tuple[tuple[int, ...], tuple[str, ...]],
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    contracted: int,
    std: float,
) -> nnx.Param | Int8Weight:
    """A projection's weight of `shape` (its first `contracted` dims are summed over), behind the
    `stack` dims; int8 with its scales when the model is quantized."""
    lead, lead_axes = stack
    if model.quantize == "int8":
        return Int8Weight((*lead, *shape), (*lead_axes, *axes), range(len(lead), len(lead) + contracted))
    return declare((*lead, *shape), (*lead_axes, *axes), model.param_dtype, std=std, quantizable=True)


einsum_projections: Project = projections_with(Plain())  # einsums in x's dtype, weight gradients in fp32


def projections(model: ModelConfig) -> Project:
    """The op a model's precision settings ask for, taking LoRA-adapted weights if it has adapters."""
    if model.quantize == "int8":
        op = int8_projections
    else:
        op = fp8_projections(model.fp8.amax_reduce) if model.fp8.enabled else einsum_projections
    return with_adapters(op, model.lora.scale, model.lora.dropout) if model.lora.rank else op
