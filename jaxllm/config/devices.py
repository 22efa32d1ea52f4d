"""What a training run needs of its devices and backend, checked before any work."""

from __future__ import annotations

from jaxllm.config.schedules import TABLE_SCHEDULES
from jaxllm.config.section import require
from jaxllm.config.sections import ModelConfig, RunConfig


def validate_tensor(m: ModelConfig, tensor: int, field_name: str) -> None:
    """Every tensor-parallel dimension splits evenly over `tensor` devices."""
    for name, value in (
        ("model.num_heads", m.num_heads),
        ("model.num_kv_heads", m.num_kv_heads),
        ("model.mlp", m.mlp),
        ("padded vocab (model.vocab_size rounded up to model.vocab_pad_multiple)", m.padded_vocab),
    ):
        require(
            value % tensor == 0,
            f"{name}={value} is not divisible by {field_name}={tensor}; choose a tensor size that divides {value}",
        )


def _validate_attention(cfg: RunConfig, backend: str | None) -> None:
    m, impl = cfg.model, cfg.model.attention
    if impl == "xla":
        return
    fix = "or set model.attention='xla'"
    require(
        backend in (None, "gpu"),
        f"model.attention={impl!r} is a GPU kernel and this machine's JAX backend is {backend!r}; "
        "set model.attention='xla' here",
    )
    if impl == "cudnn":
        require(
            m.dtype in ("bfloat16", "float16"),
            f"model.attention='cudnn' has no {m.dtype} kernel; set model.dtype='bfloat16' {fix}",
        )
        require(
            m.head_dim <= 128 and m.head_dim % 8 == 0,
            f"model.attention='cudnn' needs a head dim that is a multiple of 8 and at most 128, got {m.head_dim}; "
            f"{fix}",
        )
    else:
        require(
            m.num_kv_heads == m.num_heads,
            f"model.attention='pallas' has no grouped-query attention (model.num_kv_heads={m.num_kv_heads} < "
            f"model.num_heads={m.num_heads}); use model.attention='cudnn' {fix}",
        )
        require(
            cfg.train.seq_len % 128 == 0,
            f"model.attention='pallas' works in blocks of 128 positions and train.seq_len={cfg.train.seq_len} "
            f"is not a multiple of 128; use a multiple of 128 {fix}",
        )


def validate(cfg: RunConfig, num_devices: int, backend: str | None = None) -> tuple[int, ...]:
    """What a training run needs of its devices, checked before any work; returns the resolved
    mesh shape. With `backend` (JAX's, e.g. 'gpu'), also whether it can run the chosen kernels."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _validate_attention(cfg, backend)
    require(
        m.quantize is None or m.lora.rank > 0,
        f"model.quantize={m.quantize!r} holds int8 weights, which do not train; fine-tune LoRA adapters on "
        "the int8 base (model.lora.rank > 0), or train in full precision and serve with --quantize int8",
    )
    require(
        cfg.data.tokenizer != "bpe" or cfg.data.bpe_vocab_size <= m.vocab_size,
        f"data.bpe_vocab_size={cfg.data.bpe_vocab_size} exceeds model.vocab_size={m.vocab_size}: the trained "
        f"tokenizer's ids must fit the embedding; set model.vocab_size={cfg.data.bpe_vocab_size} or a smaller "
        "data.bpe_vocab_size",
    )
    require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
        "lower train.seq_len or raise model.max_seq_len",
    )
    shape = p.mesh_shape(num_devices)
    data, fsdp, stage, tensor = shape
    validate_tensor(m, tensor, "parallel.tensor")
    require(
        p.schedule not in TABLE_SCHEDULES or stage == 1 or m.padded_vocab % (stage * tensor) == 0,
        f"padded vocab {m.padded_vocab} (model.vocab_size rounded up to model.vocab_pad_multiple) is not divisible "
        f"by parallel.stage×tensor={stage}×{tensor}: parallel.schedule={p.schedule} splits the head's vocabulary "
        f"over both; set model.vocab_pad_multiple to a multiple of {stage * tensor}",
    )
    require(
        m.hidden % fsdp == 0,
        f"model.hidden={m.hidden} is not divisible by parallel.fsdp={fsdp}; choose an fsdp size that divides it",
    )
    per_step = data * fsdp * t.grad_accum_steps * p.microbatches
    require(
        t.batch_size % per_step == 0,
        f"train.batch_size={t.batch_size} is not divisible by data*fsdp*grad_accum_steps*microbatches="
        f"{data}*{fsdp}*{t.grad_accum_steps}*{p.microbatches}={per_step}; use a multiple of {per_step}",
    )
    if p.sequence_parallel:
        split, why = tensor * stage, f"parallel.tensor×stage={tensor}×{stage}: sequence parallelism splits it"
    else:
        split, why = stage, f"parallel.stage={stage}: the head and loss after a pipeline split it over the stages"
    require(t.seq_len % split == 0, f"train.seq_len={t.seq_len} is not divisible by {why}; use a multiple of {split}")
    return shape
