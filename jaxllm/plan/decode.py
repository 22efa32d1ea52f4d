"""How fast a decode step can go: it reads every weight once and each sequence's cached keys and
values once per token it emits, so on a GPU it is bound by memory bandwidth, not FLOP/s. (An untied
input embedding is read a row per token, not whole: counting it whole makes the limit a little low,
about 8 % for configs/1b.py.)"""

from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.plan.memory import kv_cache_bytes
from jaxllm.plan.params import weight_bytes


def decode_bytes(model: ModelConfig, sequences: int, context: int, weights: str = "bf16", kv: str = "bf16") -> float:
    """Bytes one decode step reads: the weights (a `weight_bytes` width) and the cache of
    `sequences` sequences of `context` tokens (a `kv_cache_bytes` dtype)."""
    return weight_bytes(model)[weights] + kv_cache_bytes(model, sequences, context, kv)


def decode_limit(model: ModelConfig, sequences: int, context: int, bandwidth: float, weights: str = "bf16",
                 kv: str = "bf16") -> float:  # fmt: skip
    """Tokens/s over all `sequences` if a step took only the time to read its bytes at `bandwidth`."""
    return sequences * bandwidth / decode_bytes(model, sequences, context, weights, kv)
