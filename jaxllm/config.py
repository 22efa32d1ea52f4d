"""Default settings and validation: every error names the field, its value and the fix."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from jaxllm.errors import JaxllmError

NORMS = ("rmsnorm", "layernorm")
MLP_ACTIVATIONS = ("swiglu", "geglu", "gelu")
ATTENTION = ("xla", "cudnn", "pallas")
REMAT_POLICIES = ("none", "full", "group", "selective", "dots", "offload")
MESH_AXES = ("data", "fsdp", "stage", "tensor")
FP8_AMAX_REDUCE = ("global", "local")
QUANTIZE = (None, "int8")
ROPE_SCALINGS = ("none", "linear", "llama3")


class ConfigError(JaxllmError):
    """A setting that cannot work; the message says which field and how to fix it."""


def base_config() -> ml_collections.ConfigDict:
    """Every field any tool reads, with defaults; config files override what they need."""
    cfg = ml_collections.ConfigDict()
    cfg.model = dict(
        num_layers=8,
        hidden=128,
        num_heads=4,
        num_kv_heads=placeholder(int),  # None: same as num_heads (MHA)
        head_dim=placeholder(int),  # None: hidden // num_heads
        mlp=384,
        vocab_size=4096,  # the default data.bpe_vocab_size
        vocab_pad_multiple=128,
        max_seq_len=2048,
        qkv_share_every=4,
        norm="rmsnorm",
        mlp_activation="swiglu",
        tie_embeddings=False,
        rope_theta=10000.0,
        # RoPE frequencies stretched for long context: 'none', 'linear' (every one divided by factor) or
        # 'llama3' (Llama 3.1's: low frequencies divided by factor, high ones kept, a smooth ramp between)
        rope_scaling=dict(type="none", factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192),
        dtype="bfloat16",
        param_dtype="float32",
        remat="none",
        attention="xla",  # or 'cudnn' / 'pallas' (fused, GPU only)
        # FP8 dense projections (q, k, v, o_proj, gate, up, down): e4m3 forward, e5m2 gradients, per-tensor
        # current scaling; amax_reduce='local' skips the amax pmax over tensor (layouts then differ)
        fp8=dict(enabled=False, amax_reduce="global"),
        # 'int8': the dense projections' weights stored int8 with per-output-channel scales (serving:
        # python -m jaxllm.serve --quantize int8, or an export made with --quantize int8)
        quantize=placeholder(str),
        init_std=0.02,
        norm_eps=1e-5,
    )
    cfg.parallel = dict(
        data=-1, fsdp=1, stage=1, tensor=1, microbatches=1, repeats=1, zero1=True, sequence_parallel=False,
        offload_optimizer=False,  # keep the optimizer state in pinned host memory between steps
    )  # fmt: skip
    cfg.train = dict(
        steps=100,
        batch_size=8,
        seq_len=128,
        grad_accum_steps=1,
        seed=0,
        lr=3e-4,
        min_lr_ratio=0.1,
        warmup_steps=10,
        weight_decay=0.1,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        clip_norm=1.0,
        log_every=10,
        sample_prompt="def ",
        sample_tokens=64,
        sample_temperature=0.7,  # 0 = greedy
        sample_top_k=40,
        sample_top_p=1.0,
    )
    cfg.init = dict(
        # A Hugging Face Llama directory to fine-tune: its config.json sets the model's architecture, its
        # tokenizer.json the tokenizer, its weights the initial params (the optimizer starts fresh)
        hf=placeholder(str),
    )
    cfg.checkpoint = dict(
        every_steps=100,  # 0: not by steps
        every_minutes=0.0,  # 0: not by time
        keep=3,  # the last K
        keep_every=0,  # and every M-th step for good (0: none)
        async_save=True,
        max_bad_steps=3,  # consecutive non-finite steps before restoring the last good checkpoint
    )
    cfg.debug = dict(  # fault injection, for tests
        nan_at_steps=(0,),  # steps whose loss and gradients are made non-finite (0: none)
        kill_at_step=0,  # SIGKILL this process after this step, once earlier saves have landed (0: never)
        kill_during_save=False,  # ... right after starting that step's asynchronous save
    )
    cfg.data = dict(
        inputs="stdlib",  # comma-separated globs, 'stdlib', or pkg:PACKAGE/GLOB
        tokenizer="bpe",  # 'gpt2', a path to a tokenizer.json, or 'bpe': train one on the inputs
        bpe_vocab_size=4096,
        dir="data/stdlib-bpe4096",  # holds tokens/ (prepared shards) and, for 'bpe', tokenizer/
        val_fraction=0.02,
        eval_every=50,
        eval_batches=4,
    )
    cfg.serve = dict(
        slots=8,  # requests decoded together, one KV-cache slot each
        max_len=placeholder(int),  # tokens a slot holds, prompt and output (None: model.max_seq_len)
        max_prompt_tokens=8192,
        dtype=placeholder(str),  # of the params and activations (None: model.dtype)
        kv_dtype=placeholder(str),  # of the KV cache: a float dtype, or 'int8' with per-token, per-head scales
        tensor=-1,  # devices for tensor parallelism (-1: as many local ones as split the heads evenly)
        prompt_nll=False,  # each prompt token's log-prob (the LM head over every prompt token)
        # The HTTP server (python -m jaxllm.serve without --prompt) and its guards.
        host="127.0.0.1",
        port=8000,
        model_name=placeholder(str),  # the id clients ask for (None: the run's or export's directory name)
        max_body_bytes=1 << 20,  # larger request bodies: 413
        rate_per_s=10.0,  # each API key's (or, without keys, each client address's) request rate...
        burst=40,  # ...and the burst it may spend at once; beyond: 429
        max_queue=64,  # requests waiting for a slot; beyond: 503
        request_timeout_s=600.0,  # a request still unfinished this long after it arrived ends with an error
        body_timeout_s=30.0,  # a request body still arriving after this long: 408
        max_engine_restarts=3,  # failed decode steps in a row the engine recovers from; one more stops it
        ppl_alarm=placeholder(float),  # prompt perplexity (whole, or any 32-token window) to flag; None: off
        ppl_reject=False,  # refuse flagged prompts (400) instead of only counting and logging them
    )
    return cfg


def with_defaults(saved: dict) -> ml_collections.ConfigDict:
    """A config as a checkpoint or export stored it, with defaults for fields added since."""
    cfg = base_config()
    cfg.update(saved)
    return cfg


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """Sets dotted fields ('serve.slots': 4) on `cfg` and returns it; refuses names it does not have."""
    for name, value in overrides.items():
        *parents, field = name.split(".")
        node = cfg
        for parent in parents:
            node = node.get(parent)
            if node is None:
                break
        if node is None or field not in node:
            raise ConfigError(f"--config.{name}: the config has no such field; see jaxllm/config.py for the fields")
        node[field] = value
    return cfg


def load_config(path: str | pathlib.Path) -> ml_collections.ConfigDict:
    """`get_config()` of a config file, e.g. `configs/tiny.py` (paths relative to the repo root work too)."""
    path = pathlib.Path(path)
    if not path.exists() and (pathlib.Path(__file__).parents[1] / path).exists():
        path = pathlib.Path(__file__).parents[1] / path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or not path.exists():
        raise ConfigError(f"config file {path} does not exist; pass a path such as configs/tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes that follow from `config.model`, computed here and nowhere else."""

    head_dim: int
    kv_heads: int
    groups: int  # QKV groups: num_layers / qkv_share_every
    padded_vocab: int  # vocab_size rounded up to vocab_pad_multiple, never to a mesh size
    gated: bool  # a GLU (SwiGLU, GeGLU): a gate matrix beside up and down
    ffn_matrices: int


def sizes(model: ml_collections.ConfigDict) -> Sizes:
    gated = model.mlp_activation in ("swiglu", "geglu")
    pad = model.vocab_pad_multiple
    return Sizes(
        head_dim=model.head_dim or model.hidden // model.num_heads,
        kv_heads=model.num_kv_heads or model.num_heads,
        groups=model.num_layers // model.qkv_share_every,
        padded_vocab=-(-model.vocab_size // pad) * pad,
        gated=gated,
        ffn_matrices=3 if gated else 2,
    )


def mesh_shape(parallel: ml_collections.ConfigDict, num_devices: int) -> tuple[int, ...]:
    """Mesh sizes in MESH_AXES order, with a single -1 filled from the device count."""
    sizes = [parallel[a] for a in MESH_AXES]
    asked = ", ".join(f"parallel.{a}={parallel[a]}" for a in MESH_AXES)
    if sizes.count(-1) > 1:
        raise ConfigError(f"{asked}: at most one mesh size may be -1; set the others explicitly")
    if any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"{asked}: mesh sizes must be positive (or one of them -1)")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(
                f"{asked}: the fixed sizes multiply to {known}, which does not divide the "
                f"{num_devices} devices; choose sizes whose product divides {num_devices}"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"{asked}: the mesh has {math.prod(sizes)} devices but {num_devices} exist; "
            f"make the product equal {num_devices} or set one size to -1"
        )
    return tuple(sizes)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_pipeline(m: ml_collections.ConfigDict, p: ml_collections.ConfigDict, stage: int) -> None:
    require(p.stage != -1, "parallel.stage=-1: the stage count shapes the parameters, so set it explicitly")
    require(p.microbatches >= 1 and p.repeats >= 1, "parallel.microbatches and parallel.repeats must be >= 1")
    if stage == 1:
        require(p.repeats == 1, f"parallel.repeats={p.repeats} needs a pipeline; set parallel.stage > 1 or repeats=1")
        return
    require(
        p.microbatches >= stage,
        f"parallel.microbatches={p.microbatches} < parallel.stage={stage}: a pipeline needs at least one "
        f"microbatch per stage; set microbatches >= {stage} (more shrink the bubble)",
    )
    groups = sizes(m).groups
    if groups % (stage * p.repeats):
        stages = [s for s in range(2, groups + 1) if groups % (s * p.repeats) == 0]
        raise ConfigError(
            f"model.num_layers={m.num_layers} gives {groups} QKV groups, which do not split into "
            f"parallel.stage={stage} × parallel.repeats={p.repeats}; stages fall on group boundaries, so "
            f"with repeats={p.repeats} use stage in {stages or 'none'}, or a layer count that is a multiple "
            f"of {stage * p.repeats * m.qkv_share_every}"
        )


def _validate_attention(cfg: ml_collections.ConfigDict, backend: str | None) -> None:
    m, impl = cfg.model, cfg.model.attention
    require(impl in ATTENTION, f"model.attention={impl!r} is unknown; use one of {ATTENTION}")
    if impl == "xla":
        return
    fix = "or set model.attention='xla'"
    require(
        backend in (None, "gpu"),
        f"model.attention={impl!r} is a GPU kernel and this machine's JAX backend is {backend!r}; "
        "set model.attention='xla' here",
    )
    head_dim = sizes(m).head_dim
    if impl == "cudnn":
        require(
            m.dtype in ("bfloat16", "float16"),
            f"model.attention='cudnn' has no {m.dtype} kernel; set model.dtype='bfloat16' {fix}",
        )
        require(
            head_dim <= 128 and head_dim % 8 == 0,
            f"model.attention='cudnn' needs a head dim that is a multiple of 8 and at most 128, got {head_dim}; {fix}",
        )
    else:
        require(
            sizes(m).kv_heads == m.num_heads,
            f"model.attention='pallas' has no grouped-query attention (model.num_kv_heads={m.num_kv_heads} < "
            f"model.num_heads={m.num_heads}); use model.attention='cudnn' {fix}",
        )
        require(
            cfg.train.seq_len % 128 == 0,
            f"model.attention='pallas' works in blocks of 128 positions and train.seq_len={cfg.train.seq_len} "
            f"is not a multiple of 128; use a multiple of 128 {fix}",
        )


def _validate_rope(scaling: ml_collections.ConfigDict) -> None:
    require(
        scaling.type in ROPE_SCALINGS,
        f"model.rope_scaling.type={scaling.type!r} is unknown; use one of {ROPE_SCALINGS}",
    )
    require(scaling.factor >= 1, f"model.rope_scaling.factor={scaling.factor} must be at least 1")
    require(
        scaling.type != "llama3" or scaling.high_freq_factor > scaling.low_freq_factor,
        f"model.rope_scaling.high_freq_factor={scaling.high_freq_factor} must exceed low_freq_factor="
        f"{scaling.low_freq_factor}: between them the llama3 scaling ramps from scaled to unscaled",
    )


def _validate_fp8(m: ml_collections.ConfigDict) -> None:
    reduce = m.fp8.amax_reduce
    require(reduce in FP8_AMAX_REDUCE, f"model.fp8.amax_reduce={reduce!r} is unknown; use one of {FP8_AMAX_REDUCE}")
    if not m.fp8.enabled:
        return
    for field, value in (("model.hidden", m.hidden), ("model.mlp", m.mlp), ("head dim", sizes(m).head_dim)):
        require(
            value % 16 == 0,
            f"{field}={value} is not a multiple of 16, which FP8 GEMMs (cuBLASLt) need with model.fp8.enabled; "
            "use a multiple of 16 or set model.fp8.enabled=False",
        )


def validate_tensor(m: ml_collections.ConfigDict, tensor: int, field_name: str) -> None:
    for field, value in (
        ("model.num_heads", m.num_heads),
        ("model.num_kv_heads", sizes(m).kv_heads),
        ("model.mlp", m.mlp),
        ("padded vocab (model.vocab_size rounded up to model.vocab_pad_multiple)", sizes(m).padded_vocab),
    ):
        require(
            value % tensor == 0,
            f"{field}={value} is not divisible by {field_name}={tensor}; choose a tensor size that divides {value}",
        )


def validate(cfg: ml_collections.ConfigDict, num_devices: int, backend: str | None = None) -> tuple[int, ...]:
    """Checks the whole config before any work; returns the resolved mesh shape. With `backend`
    (JAX's, e.g. 'gpu'), also whether it can run the chosen kernels."""
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.checkpoint
    require(m.norm in NORMS, f"model.norm={m.norm!r} is unknown; use one of {NORMS}")
    require(
        m.mlp_activation in MLP_ACTIVATIONS,
        f"model.mlp_activation={m.mlp_activation!r} is unknown; use one of {MLP_ACTIVATIONS}",
    )
    _validate_attention(cfg, backend)
    _validate_rope(m.rope_scaling)
    require(m.remat in REMAT_POLICIES, f"model.remat={m.remat!r} is unknown; use one of {REMAT_POLICIES}")
    _validate_fp8(m)
    require(
        m.quantize is None,
        f"model.quantize={m.quantize!r} holds int8 weights, which serve but do not train; train in full "
        "precision and serve with --quantize int8 (or export with --quantize int8)",
    )
    require(
        m.qkv_share_every >= 1 and m.num_layers % m.qkv_share_every == 0,
        f"model.num_layers={m.num_layers} is not divisible by model.qkv_share_every={m.qkv_share_every}; "
        f"use a multiple of {m.qkv_share_every} layers or another qkv_share_every",
    )
    kv = sizes(m).kv_heads
    require(
        m.num_heads % kv == 0,
        f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={kv}; "
        "each kv head must serve a whole number of query heads",
    )
    require(
        m.head_dim is not None or m.hidden % m.num_heads == 0,
        f"model.hidden={m.hidden} is not divisible by model.num_heads={m.num_heads}; set model.head_dim explicitly",
    )
    for field, value in (
        ("train.steps", t.steps), ("train.batch_size", t.batch_size), ("train.seq_len", t.seq_len),
        ("train.grad_accum_steps", t.grad_accum_steps), ("train.log_every", t.log_every),
        ("train.sample_tokens", t.sample_tokens), ("data.eval_every", cfg.data.eval_every),
        ("data.eval_batches", cfg.data.eval_batches), ("model.vocab_pad_multiple", m.vocab_pad_multiple),
        ("checkpoint.keep", c.keep), ("checkpoint.max_bad_steps", c.max_bad_steps),
    ):  # fmt: skip
        require(value >= 1, f"{field}={value} must be at least 1")
    for field, value in (
        ("checkpoint.every_steps", c.every_steps), ("checkpoint.every_minutes", c.every_minutes),
        ("checkpoint.keep_every", c.keep_every),
    ):  # fmt: skip
        require(value >= 0, f"{field}={value} must be at least 0 (0 turns it off)")
    require(
        cfg.data.tokenizer != "bpe" or cfg.data.bpe_vocab_size <= m.vocab_size,
        f"data.bpe_vocab_size={cfg.data.bpe_vocab_size} exceeds model.vocab_size={m.vocab_size}: the trained "
        f"tokenizer's ids must fit the embedding; set model.vocab_size={cfg.data.bpe_vocab_size} or a smaller "
        "data.bpe_vocab_size",
    )
    require(bool(t.sample_prompt), "train.sample_prompt is empty; give the end-of-training sample a prompt")
    require(
        t.sample_temperature >= 0 and t.sample_top_k >= 0 and 0 < t.sample_top_p <= 1,
        f"train.sample_temperature={t.sample_temperature}, sample_top_k={t.sample_top_k}, "
        f"sample_top_p={t.sample_top_p}: use a temperature >= 0 (0 = greedy), top_k >= 0 (0 = all) "
        "and 0 < top_p <= 1",
    )
    shape = mesh_shape(p, num_devices)
    data, fsdp, stage, tensor = shape
    validate_tensor(m, tensor, "parallel.tensor")
    require(
        m.hidden % fsdp == 0,
        f"model.hidden={m.hidden} is not divisible by parallel.fsdp={fsdp}; choose an fsdp size that divides it",
    )
    _validate_pipeline(m, p, stage)
    per_step = data * fsdp * t.grad_accum_steps * p.microbatches
    require(
        t.batch_size % per_step == 0,
        f"train.batch_size={t.batch_size} is not divisible by data*fsdp*grad_accum_steps*microbatches="
        f"{data}*{fsdp}*{t.grad_accum_steps}*{p.microbatches}={per_step}; use a multiple of {per_step}",
    )
    require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
        "lower train.seq_len or raise model.max_seq_len",
    )
    if p.sequence_parallel:
        split, why = tensor * stage, f"parallel.tensor×stage={tensor}×{stage}: sequence parallelism splits it"
    else:
        split, why = stage, f"parallel.stage={stage}: the head and loss after a pipeline split it over the stages"
    require(t.seq_len % split == 0, f"train.seq_len={t.seq_len} is not divisible by {why}; use a multiple of {split}")
    return shape
