"""A checkpoint's config made ready to serve: `serve.*` checked and resolved, the model and mesh
set for the serving engine."""

from __future__ import annotations

import ml_collections

from jaxllm.config import QUANTIZE, require, sizes, validate_tensor

SERVE_DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = (*SERVE_DTYPES, "int8")


def serving_config(cfg: ml_collections.ConfigDict, local_devices: int) -> ml_collections.ConfigDict:
    """A checkpoint's config made ready to serve: `serve.*` checked and resolved, the model set to
    compute in the serving dtype with plain XLA attention, no remat and no FP8 (a per-tensor scale
    over a batch of slots would make each request's output depend on the others'), and the mesh a
    `tensor` axis over local devices (no pipeline: the KV cache needs the plain stack)."""
    cfg = cfg.copy_and_resolve_references()
    m, s = cfg.model, cfg.serve
    s.max_len = s.max_len or m.max_seq_len
    s.dtype = s.dtype or m.dtype
    s.kv_dtype = s.kv_dtype or s.dtype
    if s.tensor == -1:  # the most local devices that split every tensor-parallel dimension evenly
        split = (m.num_heads, sizes(m).kv_heads, m.mlp, sizes(m).padded_vocab)
        s.tensor = max(n for n in range(1, local_devices + 1) if all(dim % n == 0 for dim in split))
    require(s.slots >= 1, f"serve.slots={s.slots} must be at least 1")
    require(
        2 <= s.max_len <= m.max_seq_len,
        f"serve.max_len={s.max_len} must be between 2 and model.max_seq_len={m.max_seq_len} (the longest "
        "context the model was built for); lower serve.max_len or raise model.max_seq_len",
    )
    require(s.max_prompt_tokens >= 1, f"serve.max_prompt_tokens={s.max_prompt_tokens} must be at least 1")
    require(0 < s.port < 65536, f"serve.port={s.port} must be in 1..65535")
    require(s.max_body_bytes >= 1, f"serve.max_body_bytes={s.max_body_bytes} must be at least 1")
    require(s.rate_per_s > 0, f"serve.rate_per_s={s.rate_per_s} must be above 0 (requests per second per key)")
    require(s.burst >= 1, f"serve.burst={s.burst} must be at least 1")
    require(s.max_queue >= 0, f"serve.max_queue={s.max_queue} must be at least 0")
    for field in ("request_timeout_s", "body_timeout_s"):
        require(s[field] > 0, f"serve.{field}={s[field]} must be above 0 (seconds)")
    require(s.max_engine_restarts >= 0, f"serve.max_engine_restarts={s.max_engine_restarts} must be at least 0")
    require(
        s.ppl_alarm is None or s.ppl_alarm > 1,
        f"serve.ppl_alarm={s.ppl_alarm} must be above 1 (a perplexity), or None to turn the alarm off",
    )
    require(not s.ppl_reject or s.ppl_alarm is not None, "serve.ppl_reject needs serve.ppl_alarm, the threshold")
    s.prompt_nll = s.prompt_nll or s.ppl_alarm is not None  # the alarm reads the prompt's log-probs
    require(s.dtype in SERVE_DTYPES, f"serve.dtype={s.dtype!r} is unknown; use one of {SERVE_DTYPES}")
    require(s.kv_dtype in KV_DTYPES, f"serve.kv_dtype={s.kv_dtype!r} is unknown; use one of {KV_DTYPES}")
    require(m.quantize in QUANTIZE, f"model.quantize={m.quantize!r} is unknown; use one of {QUANTIZE}")
    require(
        1 <= s.tensor <= local_devices,
        f"serve.tensor={s.tensor}: this host has {local_devices} devices; use 1 to {local_devices} (-1: all)",
    )
    validate_tensor(m, s.tensor, "serve.tensor")
    m.update(dtype=s.dtype, attention="xla", remat="none")
    m.fp8.enabled = False
    cfg.parallel.update(data=1, fsdp=1, stage=1, tensor=s.tensor, microbatches=1, repeats=1, sequence_parallel=False)
    return cfg
