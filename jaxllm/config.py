"""Typed configuration: one frozen, hashable dataclass per section, each checking itself when it is
built (every error names the field, its value and the fix) and deriving what follows from it as
properties; `RunConfig` holds a training run's sections and checks them together; `validate` adds
what depends on the devices.

What users write stays an `ml_collections.ConfigDict` (`configs/*.py`, `--config.x.y=v`, a
checkpoint's stored config): `RunConfig.from_dict` converts it once, at the command line's edge,
and nothing below that edge sees a ConfigDict. `base_config()` is that ConfigDict, made from the
dataclasses' own defaults.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, NamedTuple

import ml_collections
from ml_collections.config_dict import placeholder

from jaxllm.errors import JaxllmError

Norm = Literal["rmsnorm", "layernorm"]
MlpActivation = Literal["swiglu", "geglu", "gelu"]
AttentionKernel = Literal["xla", "cudnn", "pallas"]
RematPolicy = Literal["none", "full", "group", "selective", "dots", "offload"]
AmaxReduce = Literal["global", "local"]
RopeScalingType = Literal["none", "linear", "llama3"]
Quantize = Literal["int8"]
REMAT_POLICIES = typing.get_args(RematPolicy)
MESH_AXES = ("data", "fsdp", "stage", "tensor")
RETIRED_SECTIONS = ("debug", "serve")  # in configs stored before: fault injection moved out, serving owns its own


class ConfigError(JaxllmError):
    """A setting that cannot work; the message says which field and how to fix it."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def field(default: Any, help: str) -> Any:
    """A setting with its one-line description (what `--help` shows)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Section:
    """A section of settings: built from a mapping (unknown fields refused by name), written back
    as a plain dict, changed by copy."""

    name: ClassVar[str]

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            allowed = _choices(hints[f.name])
            value = getattr(self, f.name)
            require(not allowed or value in allowed, f"{self.name}.{f.name}={value!r} is unknown; use one of {allowed}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> typing.Self:
        hints, known = typing.get_type_hints(cls), {f.name for f in dataclasses.fields(cls)}
        for key in values:
            unknown = f"{cls.name}.{key}: the config has no such field; see jaxllm/config.py for the fields"
            require(key in known, unknown)
        kwargs = {}
        for key, value in values.items():
            kind = hints[key]
            kwargs[key] = kind.from_dict(value) if isinstance(kind, type) and issubclass(kind, Section) else value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The settings as written: plain values, each section a dict."""
        return {f.name: _written(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> typing.Self:
        """A copy with `changes` (a nested section as a section or a dict), built and checked anew."""
        return type(self).from_dict(self.to_dict() | {k: _written(v) for k, v in changes.items()})


def _written(value: Any) -> Any:
    return value.to_dict() if isinstance(value, Section) else value


def _choices(kind: Any) -> tuple:
    """The allowed values of a Literal type (with None if it is optional), else (): any."""
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if all(typing.get_origin(a) is Literal for a in args):
            return (*(c for a in args for c in typing.get_args(a)), None)
    return ()


@dataclasses.dataclass(frozen=True)
class RopeScaling(Section):
    name: ClassVar[str] = "model.rope_scaling"
    type: RopeScalingType = field("none", "'none', 'linear' (every frequency / factor) or 'llama3' (Llama 3.1's ramp)")
    factor: float = field(1.0, "how far the context is stretched")
    low_freq_factor: float = field(1.0, "llama3: wavelengths past original_max_len / this are scaled")
    high_freq_factor: float = field(4.0, "llama3: wavelengths under original_max_len / this are kept")
    original_max_len: int = field(8192, "llama3: the context the model was first trained for")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.factor >= 1, f"model.rope_scaling.factor={self.factor} must be at least 1")
        require(
            self.type != "llama3" or self.high_freq_factor > self.low_freq_factor,
            f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
            f"{self.low_freq_factor}: between them the llama3 scaling ramps from scaled to unscaled",
        )


@dataclasses.dataclass(frozen=True)
class Fp8Config(Section):
    name: ClassVar[str] = "model.fp8"
    enabled: bool = field(False, "the dense projections in FP8: e4m3 forward, e5m2 gradients, current scaling")
    amax_reduce: AmaxReduce = field("global", "'local' skips the amax reduction over tensor (layouts then differ)")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """The architecture. `num_kv_heads` and `head_dim` left None are resolved when built (to
    `num_heads`, `hidden // num_heads`)."""

    name: ClassVar[str] = "model"
    num_layers: int = field(8, "decoder layers")
    hidden: int = field(128, "the residual stream's width")
    num_heads: int = field(4, "query heads")
    num_kv_heads: int | None = field(None, "key/value heads (GQA); None: num_heads")
    head_dim: int | None = field(None, "None: hidden // num_heads")
    mlp: int = field(384, "the feed-forward's inner width")
    vocab_size: int = field(4096, "token ids the model knows")
    vocab_pad_multiple: int = field(128, "the embedding's rows are padded up to a multiple of this")
    max_seq_len: int = field(2048, "the longest context")
    qkv_share_every: int = field(4, "consecutive layers that share one QKV projection (1: none)")
    norm: Norm = field("rmsnorm", "'rmsnorm' or 'layernorm'")
    mlp_activation: MlpActivation = field("swiglu", "'swiglu', 'geglu' or 'gelu' (a plain MLP)")
    tie_embeddings: bool = field(False, "the LM head is the embedding's transpose")
    rope_theta: float = field(10000.0, "RoPE's base")
    rope_scaling: RopeScaling = field(RopeScaling(), "RoPE frequencies stretched for long context")
    dtype: str = field("bfloat16", "the compute dtype")
    param_dtype: str = field("float32", "the master weights' dtype")
    remat: RematPolicy = field("none", "what the backward pass recomputes")
    attention: AttentionKernel = field("xla", "'xla' (everywhere), 'cudnn' or 'pallas' (fused, GPU only)")
    fp8: Fp8Config = field(Fp8Config(), "FP8 dense projections")
    quantize: Quantize | None = field(None, "'int8': int8 weights with per-output-channel scales (serving only)")
    init_std: float = field(0.02, "the initial weights' standard deviation")
    norm_eps: float = field(1e-5, "the norms' epsilon")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.qkv_share_every >= 1 and self.num_layers % self.qkv_share_every == 0,
            f"model.num_layers={self.num_layers} is not divisible by model.qkv_share_every={self.qkv_share_every}; "
            f"use a multiple of {self.qkv_share_every} layers or another qkv_share_every",
        )
        require(
            self.head_dim is not None or self.hidden % self.num_heads == 0,
            f"model.hidden={self.hidden} is not divisible by model.num_heads={self.num_heads}; set model.head_dim "
            "explicitly",
        )
        # Resolved here, and written back as None: a later change of num_heads or hidden re-derives them.
        object.__setattr__(self, "_derived", tuple(n for n in ("num_kv_heads", "head_dim") if getattr(self, n) is None))
        object.__setattr__(self, "num_kv_heads", self.num_kv_heads or self.num_heads)
        object.__setattr__(self, "head_dim", self.head_dim or self.hidden // self.num_heads)
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}; "
            "each kv head must serve a whole number of query heads",
        )
        require(self.vocab_pad_multiple >= 1, f"model.vocab_pad_multiple={self.vocab_pad_multiple} must be at least 1")
        if self.fp8.enabled:
            for name, value in (("model.hidden", self.hidden), ("model.mlp", self.mlp), ("head dim", self.head_dim)):
                require(
                    value % 16 == 0,
                    f"{name}={value} is not a multiple of 16, which FP8 GEMMs (cuBLASLt) need with "
                    "model.fp8.enabled; use a multiple of 16 or set model.fp8.enabled=False",
                )

    def to_dict(self) -> dict[str, Any]:
        return super().to_dict() | dict.fromkeys(self._derived)

    @property
    def groups(self) -> int:
        """QKV groups: num_layers / qkv_share_every."""
        return self.num_layers // self.qkv_share_every

    @property
    def padded_vocab(self) -> int:
        """vocab_size rounded up to vocab_pad_multiple, never to a mesh size."""
        return -(-self.vocab_size // self.vocab_pad_multiple) * self.vocab_pad_multiple

    @property
    def gated(self) -> bool:
        """A GLU (SwiGLU, GeGLU): a gate matrix beside up and down."""
        return self.mlp_activation in ("swiglu", "geglu")

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.gated else 2


class Schedule(NamedTuple):
    """A pipeline's schedule (see `parallel/schedule.py` for the views it puts on groups)."""

    stages: int
    repeats: int
    microbatches: int

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Fraction of stage-iterations that do no useful work."""
        return (self.stages - 1) / self.iterations


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Section):
    name: ClassVar[str] = "parallel"
    data: int = field(-1, "data-parallel replicas (-1: what the other sizes leave of the devices)")
    fsdp: int = field(1, "devices the params and optimizer state are sharded over (ZeRO-3)")
    stage: int = field(1, "pipeline stages")
    tensor: int = field(1, "tensor-parallel devices (Megatron's, by heads)")
    microbatches: int = field(1, "a pipeline's microbatches per step")
    repeats: int = field(1, "a circular pipeline's passes over the stages")
    zero1: bool = field(True, "the optimizer state (and summed gradients) also split over data")
    sequence_parallel: bool = field(False, "the residual stream split over tensor along the sequence")
    offload_optimizer: bool = field(False, "the optimizer state in pinned host memory between steps")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.stage != -1, "parallel.stage=-1: the stage count shapes the parameters, so set it explicitly")
        require(self.microbatches >= 1 and self.repeats >= 1, "parallel.microbatches and parallel.repeats must be >= 1")
        require(
            self.stage > 1 or self.repeats == 1,
            f"parallel.repeats={self.repeats} needs a pipeline; set parallel.stage > 1 or repeats=1",
        )
        require(
            self.stage == 1 or self.microbatches >= self.stage,
            f"parallel.microbatches={self.microbatches} < parallel.stage={self.stage}: a pipeline needs at least "
            f"one microbatch per stage; set microbatches >= {self.stage} (more shrink the bubble)",
        )

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh sizes as given (one may be -1), by axis."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def schedule(self) -> Schedule | None:
        """The pipeline schedule, or None when `stage` is 1."""
        return Schedule(self.stage, self.repeats, self.microbatches) if self.stage > 1 else None

    def mesh_shape(self, num_devices: int) -> tuple[int, ...]:
        """Mesh sizes in MESH_AXES order, with a single -1 filled from the device count."""
        sizes = list(self.sizes.values())
        asked = ", ".join(f"parallel.{a}={s}" for a, s in self.sizes.items())
        require(sizes.count(-1) <= 1, f"{asked}: at most one mesh size may be -1; set the others explicitly")
        require(all(s > 0 or s == -1 for s in sizes), f"{asked}: mesh sizes must be positive (or one of them -1)")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            require(
                num_devices % known == 0,
                f"{asked}: the fixed sizes multiply to {known}, which does not divide the {num_devices} devices; "
                f"choose sizes whose product divides {num_devices}",
            )
            sizes[sizes.index(-1)] = num_devices // known
        require(
            math.prod(sizes) == num_devices,
            f"{asked}: the mesh has {math.prod(sizes)} devices but {num_devices} exist; make the product equal "
            f"{num_devices} or set one size to -1",
        )
        return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    name: ClassVar[str] = "train"
    steps: int = field(100, "optimizer steps")
    batch_size: int = field(8, "sequences per step")
    seq_len: int = field(128, "tokens per sequence")
    grad_accum_steps: int = field(1, "microsteps whose gradients add up to one step")
    seed: int = field(0, "initial weights, data order and the sample")
    lr: float = field(3e-4, "peak learning rate")
    min_lr_ratio: float = field(0.1, "the cosine decay's floor, as a fraction of lr")
    warmup_steps: int = field(10, "linear warmup from 0")
    weight_decay: float = field(0.1, "AdamW's, on every weight that decays (not norms)")
    b1: float = field(0.9, "Adam's beta1")
    b2: float = field(0.95, "Adam's beta2")
    eps: float = field(1e-8, "Adam's epsilon")
    clip_norm: float = field(1.0, "gradients clipped to this global norm")
    log_every: int = field(10, "steps between logged metrics")
    sample_prompt: str = field("def ", "the end-of-training sample's prompt")
    sample_tokens: int = field(64, "the sample's length")
    sample_temperature: float = field(0.7, "the sample's temperature (0: greedy)")
    sample_top_k: int = field(40, "the sample's top-k (0: all)")
    sample_top_p: float = field(1.0, "the sample's top-p")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "batch_size", "seq_len", "grad_accum_steps", "log_every", "sample_tokens"):
            require(getattr(self, name) >= 1, f"train.{name}={getattr(self, name)} must be at least 1")
        require(bool(self.sample_prompt), "train.sample_prompt is empty; give the end-of-training sample a prompt")
        require(
            self.sample_temperature >= 0 and self.sample_top_k >= 0 and 0 < self.sample_top_p <= 1,
            f"train.sample_temperature={self.sample_temperature}, sample_top_k={self.sample_top_k}, "
            f"sample_top_p={self.sample_top_p}: use a temperature >= 0 (0 = greedy), top_k >= 0 (0 = all) "
            "and 0 < top_p <= 1",
        )


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    name: ClassVar[str] = "data"
    inputs: str = field("stdlib", "comma-separated globs, 'stdlib', or pkg:PACKAGE/GLOB")
    tokenizer: str = field("bpe", "'gpt2', a path to a tokenizer.json, or 'bpe': train one on the inputs")
    bpe_vocab_size: int = field(4096, "the trained BPE's vocabulary")
    dir: str = field("data/stdlib-bpe4096", "holds tokens/ (prepared shards) and, for 'bpe', tokenizer/")
    val_fraction: float = field(0.02, "documents held out for validation")
    eval_every: int = field(50, "steps between validation losses")
    eval_batches: int = field(4, "batches per validation loss")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("eval_every", "eval_batches"):
            require(getattr(self, name) >= 1, f"data.{name}={getattr(self, name)} must be at least 1")


@dataclasses.dataclass(frozen=True)
class InitConfig(Section):
    name: ClassVar[str] = "init"
    hf: str | None = field(
        None, "a Hugging Face Llama directory to fine-tune: its architecture, tokenizer and weights"
    )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    name: ClassVar[str] = "checkpoint"
    every_steps: int = field(100, "steps between saves (0: not by steps)")
    every_minutes: float = field(0.0, "minutes between saves (0: not by time)")
    keep: int = field(3, "the last K checkpoints kept")
    keep_every: int = field(0, "and every M-th step for good (0: none)")
    async_save: bool = field(True, "saves overlap the next steps")
    max_bad_steps: int = field(3, "non-finite steps in a row before restoring the last good checkpoint")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("keep", "max_bad_steps"):
            require(getattr(self, name) >= 1, f"checkpoint.{name}={getattr(self, name)} must be at least 1")
        for name in ("every_steps", "every_minutes", "keep_every"):
            value = getattr(self, name)
            require(value >= 0, f"checkpoint.{name}={value} must be at least 0 (0 turns it off)")


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
    """A training run: its sections, checked together."""

    name: ClassVar[str] = "config"
    model: ModelConfig = field(ModelConfig(), "the architecture")
    parallel: ParallelConfig = field(ParallelConfig(), "the mesh and pipeline")
    train: TrainConfig = field(TrainConfig(), "the optimizer, steps and sample")
    data: DataConfig = field(DataConfig(), "the corpus and tokenizer")
    init: InitConfig = field(InitConfig(), "where the weights start")
    checkpoint: CheckpointConfig = field(CheckpointConfig(), "saves, retention and faults")

    def __post_init__(self) -> None:
        super().__post_init__()
        m, p = self.model, self.parallel
        if p.stage > 1 and m.groups % (p.stage * p.repeats):
            stages = [s for s in range(2, m.groups + 1) if m.groups % (s * p.repeats) == 0]
            raise ConfigError(
                f"model.num_layers={m.num_layers} gives {m.groups} QKV groups, which do not split into "
                f"parallel.stage={p.stage} × parallel.repeats={p.repeats}; stages fall on group boundaries, so "
                f"with repeats={p.repeats} use stage in {stages or 'none'}, or a layer count that is a multiple "
                f"of {p.stage * p.repeats * m.qkv_share_every}"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunConfig:
        """A run config from what users write or a checkpoint stored (fields missing there take their
        defaults; the sections that moved out of it are left out)."""
        values = _plain(values)
        return super().from_dict({k: v for k, v in values.items() if k not in RETIRED_SECTIONS})

    def updated(self, **sections: Mapping[str, Any]) -> RunConfig:
        """A copy with some fields of some sections changed, e.g. `updated(parallel=dict(stage=2))`;
        nested sections take dicts too. The result is checked as a whole."""
        return RunConfig.from_dict(_merged(self.to_dict(), sections))

    def overridden(self, dotted: Mapping[str, Any]) -> RunConfig:
        """A copy with dotted fields changed, as the command line names them: {'train.steps': 5}."""
        return RunConfig.from_dict(apply_overrides(ml_collections.ConfigDict(self.to_dict()), dotted))


def _plain(values: Any) -> Any:
    """A ConfigDict (or any mapping) as nested plain dicts."""
    if isinstance(values, ml_collections.ConfigDict):
        return values.to_dict()
    return {k: _plain(v) for k, v in values.items()} if isinstance(values, Mapping) else values


def _merged(base: dict, changes: Mapping) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, Mapping) else value
    return out


def base_config(*sections: type[Section]) -> ml_collections.ConfigDict:
    """What config files and `--config.x.y=v` overrides start from: every field of a run (and of
    the `sections` a tool adds, each under its name), with its default. A field whose default is
    None is a typed placeholder, so an override is checked against its type."""

    def as_dict(section: type[Section]) -> dict:
        hints = typing.get_type_hints(section)
        out = {}
        for f in dataclasses.fields(section):
            kind, default = hints[f.name], f.default
            if isinstance(kind, type) and issubclass(kind, Section):
                out[f.name] = as_dict(kind)
            elif default is None:
                out[f.name] = placeholder(_optional_type(kind))
            else:
                out[f.name] = default
        return out

    cfg = ml_collections.ConfigDict(as_dict(RunConfig))
    for section in sections:
        cfg[section.name] = as_dict(section)
    return cfg


def _optional_type(kind: Any) -> type:
    """The type a placeholder holds: T of `T | None` (str for a Literal's values)."""
    arg = next(a for a in typing.get_args(kind) if a is not type(None))
    return type(typing.get_args(arg)[0]) if typing.get_origin(arg) is Literal else arg


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """Sets dotted fields ('serve.slots': 4) on `cfg` and returns it; refuses names it does not have."""
    for name, value in overrides.items():
        *parents, leaf = name.split(".")
        node = cfg
        for parent in parents:
            node = node.get(parent)
            if node is None:
                break
        if node is None or leaf not in node:
            raise ConfigError(f"--config.{name}: the config has no such field; see jaxllm/config.py for the fields")
        node[leaf] = value
    return cfg


def load_config(path: str | pathlib.Path, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The run config of a config file, e.g. `configs/tiny.py` (paths relative to the repo root
    work too): its `get_config()`, with dotted `overrides` ({'train.steps': 5}) on top."""
    path = pathlib.Path(path)
    if not path.exists() and (pathlib.Path(__file__).parents[1] / path).exists():
        path = pathlib.Path(__file__).parents[1] / path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or not path.exists():
        raise ConfigError(f"config file {path} does not exist; pass a path such as configs/tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.get_config()
    if not isinstance(written, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config() returned a {type(written).__name__}; return a ConfigDict")
    return RunConfig.from_dict(apply_overrides(written, overrides or {}))


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
        m.quantize is None,
        f"model.quantize={m.quantize!r} holds int8 weights, which serve but do not train; train in full "
        "precision and serve with --quantize int8 (or export with --quantize int8)",
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
