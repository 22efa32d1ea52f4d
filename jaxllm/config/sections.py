"""The sections of a training run's config, each a frozen dataclass that checks itself and
derives what follows from it, and `RunConfig`, which holds them and checks them together."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import ml_collections

from jaxllm.config.schedules import CHUNKED_SCHEDULES, TABLE_SCHEDULES, PipelineSchedule, Schedule
from jaxllm.config.section import ConfigError, Section, _merged, _plain, apply_overrides, field, require

Norm = Literal["rmsnorm", "layernorm"]
MlpActivation = Literal["swiglu", "geglu", "gelu"]
AttentionKernel = Literal["xla", "cudnn", "pallas"]
RematPolicy = Literal["none", "full", "group", "selective", "dots", "offload"]
AmaxReduce = Literal["global", "local"]
RopeScalingType = Literal["none", "linear", "llama3"]
Quantize = Literal["int8"]
REMAT_POLICIES = typing.get_args(RematPolicy)
MESH_AXES = ("data", "fsdp", "stage", "tensor")
FAKE_DEVICES = "; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N fake devices"
RETIRED_SECTIONS = ("debug", "serve")  # in configs stored before: fault injection moved out, serving owns its own


@dataclasses.dataclass(frozen=True)
class RopeScaling(Section):
    """RoPE frequencies stretched for long context: `linear` (every frequency divided by `factor`) or
    Llama 3.1's `llama3` ramp between scaled and kept wavelengths."""

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
    """The seven dense projections (q, k, v, o_proj, gate, up, down) in FP8 with per-tensor current
    scaling: e4m3 operands forward, e5m2 gradients backward, fp32 accumulation."""

    name: ClassVar[str] = "model.fp8"
    enabled: bool = field(False, "the dense projections in FP8: e4m3 forward, e5m2 gradients, current scaling")
    amax_reduce: AmaxReduce = field("global", "'local' skips the amax reduction over tensor (layouts then differ)")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraConfig(Section):
    """Low-rank adapters (LoRA): each targeted projection W gains A·B·alpha/rank; only A and B train."""

    name: ClassVar[str] = "model.lora"
    rank: int = field(0, "the adapters' rank (0: no adapters, every weight trains)")
    alpha: float = field(16.0, "the update's scale is alpha / rank")
    dropout: float = field(0.0, "the fraction of an adapter's input dropped while training (PEFT's lora_dropout)")
    targets: str = field("q,k,v,o,gate,up,down", "comma-separated projections among " + ", ".join(LORA_TARGETS))

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.rank >= 0, f"model.lora.rank={self.rank} must be at least 0 (0: no adapters)")
        unknown = sorted(set(self.target_names) - set(LORA_TARGETS))
        require(
            not unknown and (self.rank == 0 or self.target_names),
            f"model.lora.targets={self.targets!r}: {', '.join(unknown) or 'none named'}; name projections among "
            + ", ".join(LORA_TARGETS),
        )
        require(
            0.0 <= self.dropout < 1.0,
            f"model.lora.dropout={self.dropout} must be at least 0 and below 1 (the fraction dropped; 0: none)",
        )

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


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
    quantize: Quantize | None = field(
        None, "'int8': int8 weights with per-output-channel scales (serving, or a LoRA run's frozen base)"
    )
    lora: LoraConfig = field(LoraConfig(), "low-rank adapters: only they train, the base weights stay frozen")
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


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Section):
    """The device mesh (`data`, `fsdp`, `stage`, `tensor`; one size may be -1: the remaining devices),
    the pipeline's schedule, and where the optimizer state lives."""

    name: ClassVar[str] = "parallel"
    data: int = field(-1, "data-parallel replicas (-1: what the other sizes leave of the devices)")
    fsdp: int = field(1, "devices the params and optimizer state are sharded over (ZeRO-3)")
    stage: int = field(1, "pipeline stages")
    tensor: int = field(1, "tensor-parallel devices (Megatron's, by heads)")
    microbatches: int = field(1, "a pipeline's microbatches per step")
    repeats: int = field(1, "chunks per stage: a circular or interleaved pipeline's passes over the stages")
    schedule: PipelineSchedule = field(
        "gpipe",
        "the pipeline's order of work: gpipe (all forwards, then all backwards), circular (gpipe over "
        "`repeats` chunks per stage), 1f1b (a microbatch's backward as soon as it can: a few "
        "microbatches held per stage, not all), interleaved_1f1b (1f1b over `repeats` chunks: a "
        "smaller bubble), zero_bubble (1f1b with each backward's weight gradients put off into the "
        "bubble, ZB-H1), interleaved_zero_bubble (zero_bubble over `repeats` chunks)",
    )
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
        chunked = self.schedule in CHUNKED_SCHEDULES
        require(
            self.repeats == 1 or chunked,
            f"parallel.repeats={self.repeats} with parallel.schedule={self.schedule}: chunks per stage need "
            f"schedule={' or '.join(CHUNKED_SCHEDULES)} (or repeats=1)",
        )
        require(
            self.repeats > 1 or not chunked or self.stage == 1,
            f"parallel.schedule={self.schedule} passes over the stages `repeats` times; set parallel.repeats >= 2 "
            f"(or schedule={CHUNKED_SCHEDULES.get(self.schedule)})",
        )
        require(
            not (chunked and self.schedule in TABLE_SCHEDULES) or self.microbatches % self.stage == 0,
            f"parallel.schedule={self.schedule} sends microbatches through each chunk in groups of "
            f"parallel.stage={self.stage}; set parallel.microbatches={self.microbatches} to a multiple of it",
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
    def pipeline(self) -> Schedule | None:
        """The pipeline schedule, or None when `stage` is 1."""
        return Schedule(self.stage, self.repeats, self.microbatches, self.schedule) if self.stage > 1 else None

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
                f"choose sizes whose product divides {num_devices}{FAKE_DEVICES}",
            )
            sizes[sizes.index(-1)] = num_devices // known
        require(
            math.prod(sizes) == num_devices,
            f"{asked}: the mesh has {math.prod(sizes)} devices but {num_devices} exist; make the product equal "
            f"{num_devices} or set one size to -1{FAKE_DEVICES}",
        )
        return tuple(sizes)


def step_range(text: str | None, name: str) -> tuple[int, int] | None:
    """Steps 'A:B' (A <= B, both >= 1, inclusive) as (A, B); None for '' (off). `name` is the
    setting, named in the error."""
    if not text:
        return None
    parts = str(text).split(":")
    fix = f"write it as A:B with 1 <= A <= B, e.g. {name}=3:4 (or '' for no profile)"
    require(len(parts) == 2 and all(p.strip().isdigit() for p in parts), f"{name}={text!r} is not a step range; {fix}")
    first, last = (int(p) for p in parts)
    require(1 <= first <= last, f"{name}={text!r}: the steps must satisfy 1 <= A <= B; {fix}")
    return first, last


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    """The steps and batch, AdamW with linear warmup and cosine decay to `lr · min_lr_ratio`, and the
    sample printed at the end of training."""

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
    compile_cache: str | None = field(None, "JAX's persistent compilation cache, so a restarted or resumed run loads "
                                            "its steps instead of compiling them (None: $JAX_COMPILATION_CACHE_DIR, "
                                            "else WORKDIR/xla-cache; 'off': none)")  # fmt: skip
    profile_steps: str = field(
        "",
        "'A:B': trace steps A to B (inclusive) with jax.profiler into WORKDIR/profile/ and print a summary ('': off)",
    )
    sample_prompt: str = field("def ", "the end-of-training sample's prompt")
    sample_tokens: int = field(64, "the sample's length (0: no sample)")
    sample_temperature: float = field(0.7, "the sample's temperature (0: greedy)")
    sample_top_k: int = field(40, "the sample's top-k (0: all)")
    sample_top_p: float = field(1.0, "the sample's top-p")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "batch_size", "seq_len", "grad_accum_steps", "log_every"):
            require(getattr(self, name) >= 1, f"train.{name}={getattr(self, name)} must be at least 1")
        require(self.sample_tokens >= 0, f"train.sample_tokens={self.sample_tokens} must be at least 0 (0: no sample)")
        if (profiled := step_range(self.profile_steps, "train.profile_steps")) is not None:
            require(
                profiled[1] <= self.steps,
                f"train.profile_steps={self.profile_steps!r} ends after train.steps={self.steps}; profile steps "
                f"up to {self.steps} or train longer",
            )
        require(bool(self.sample_prompt), "train.sample_prompt is empty; give the end-of-training sample a prompt")
        require(
            self.sample_temperature >= 0 and self.sample_top_k >= 0 and 0 < self.sample_top_p <= 1,
            f"train.sample_temperature={self.sample_temperature}, sample_top_k={self.sample_top_k}, "
            f"sample_top_p={self.sample_top_p}: use a temperature >= 0 (0 = greedy), top_k >= 0 (0 = all) "
            "and 0 < top_p <= 1",
        )


DataFormat = Literal["text", "chat", "prompt_completion"]
Overlong = Literal["truncate", "error"]


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """The corpus, what it holds, its tokenizer, where it is prepared, and the validation loss's cadence."""

    name: ClassVar[str] = "data"
    inputs: str = field("stdlib", "comma-separated globs, 'stdlib', or pkg:PACKAGE/GLOB")
    format: DataFormat = field("text", "what inputs hold: text, chat (messages), prompt_completion (see docs/data.md)")
    text_field: str = field("text", "the text format's JSONL field or Parquet/dataset column")
    chat_template: str | None = field(None, "a Jinja file to render chat data (None: the tokenizer's, else built in)")
    overlong: Overlong = field("truncate", "a chat/prompt_completion example longer than seq_len+1: truncate or error")
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
        require(bool(self.text_field), "data.text_field is empty; name the field or column that holds the text")
        require(
            self.chat_template is None or pathlib.Path(self.chat_template).is_file(),
            f"data.chat_template={self.chat_template!r} is not a file; give a Jinja template file, or None for the "
            "tokenizer's own (else the built-in one)",
        )


@dataclasses.dataclass(frozen=True)
class InitConfig(Section):
    """Where the weights start: a fresh initialisation from `train.seed`, or a Hugging Face Llama."""

    name: ClassVar[str] = "init"
    hf: str | None = field(None, "a Hugging Face Llama directory to fine-tune: its architecture, tokenizer and weights")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """When checkpoints are saved, which are kept, and how many non-finite steps in a row roll a run
    back."""

    name: ClassVar[str] = "checkpoint"
    every_steps: int = field(100, "steps between saves (0: not by steps)")
    every_minutes: float = field(0.0, "minutes between saves (0: not by time)")
    keep: int = field(3, "the last K checkpoints kept")
    keep_every: int = field(0, "and every M-th step for good (0: none)")
    async_save: bool = field(True, "saves overlap the next steps")
    max_bad_steps: int = field(3, "non-finite steps in a row before restoring the last good checkpoint")
    local_dir: str = field("", "the fast tier: a directory on each host's own disk or RAM disk ('': none)")
    local_every_steps: int = field(0, "steps between fast-tier saves (0: not by steps)")
    local_every_minutes: float = field(0.0, "minutes between fast-tier saves (0: not by time)")
    local_keep: int = field(2, "the last K fast-tier saves kept on each host")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("keep", "max_bad_steps", "local_keep"):
            require(getattr(self, name) >= 1, f"checkpoint.{name}={getattr(self, name)} must be at least 1")
        for name in ("every_steps", "every_minutes", "keep_every", "local_every_steps", "local_every_minutes"):
            value = getattr(self, name)
            require(value >= 0, f"checkpoint.{name}={value} must be at least 0 (0 turns it off)")
        require(
            not self.local_dir or self.local_every_steps > 0 or self.local_every_minutes > 0,
            f"checkpoint.local_dir={self.local_dir!r} is set but the fast tier is never saved; set "
            "checkpoint.local_every_steps or checkpoint.local_every_minutes (or local_dir='' for no fast tier)",
        )


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
