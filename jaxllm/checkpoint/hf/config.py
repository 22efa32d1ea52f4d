"""A Hugging Face Llama `config.json` ↔ jaxllm's `config.model`: each field the Llama architecture
has, mapped once each way, and a refusal that names the field for anything it cannot express."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jaxllm.config import ModelConfig, RunConfig
from jaxllm.errors import JaxllmError

# HF rope_type → model.rope_scaling.type, and the fields each needs; the others (dynamic, yarn,
# longrope) are refused.
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SIZES_NEEDED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


class ConversionError(JaxllmError):
    """A model or file that cannot be converted; the message names the field or file and the fix."""


def read_json(path: pathlib.Path) -> dict | None:
    """A JSON file's contents, None if it is absent; refuses one that does not parse."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e}); restore it from the model's original files") from e


def is_hf_dir(path: str | pathlib.Path) -> bool:
    """A Hugging Face model directory: a config.json with a model_type (an export's has a model section)."""
    config = read_json(pathlib.Path(path) / "config.json")
    return isinstance(config, dict) and "model_type" in config


def require_hf_dir(path: str | pathlib.Path, flag: str) -> pathlib.Path:
    """`path`, absolute, if it is a Hugging Face model directory; else an error naming `flag`."""
    if not is_hf_dir(path):
        raise ConversionError(f"{flag} {path}: no Hugging Face config.json (with a model_type) there; pass the "
                              "directory of a Llama saved by transformers")  # fmt: skip
    return pathlib.Path(path).absolute()


def _rope(hf: dict) -> dict:
    """θ and scaling, as transformers 5 (`rope_parameters`) or earlier (`rope_theta`, `rope_scaling`) writes them."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return rope


def model_fields(hf: dict, source: str) -> dict[str, Any]:
    """`config.model` fields for a Llama `config.json` (its contents `hf`, read from `source`)."""

    def refuse(field: str, why: str):
        raise ConversionError(f"{source}: {field}={hf.get(field)!r} {why}")

    def need(field: str):
        if field not in hf:
            raise ConversionError(f"{source} has no {field!r}; a Llama config.json names it")
        return hf[field]

    if hf.get("model_type") != "llama":
        refuse("model_type", "is not a Llama model; jaxllm converts model_type 'llama' (LlamaForCausalLM)")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "is not SwiGLU's silu, the only gated activation a Llama has")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias):
            refuse(bias, "adds biases, which jaxllm's projections do not have")
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                  "num_key_value_heads", "head_dim", "max_position_embeddings"):  # fmt: skip
        value = need(field) if field in SIZES_NEEDED else hf.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            refuse(field, "must be a positive integer")
    rope = _rope(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConversionError(f"{source}: rope_scaling.rope_type={kind!r} is not implemented; jaxllm implements "
                              f"{sorted(ROPE_TYPES)}, so convert a model that uses one of those")  # fmt: skip
    missing = [k for k in ROPE_FIELDS[kind] if k not in rope]
    if missing:
        raise ConversionError(f"{source}: rope_scaling of rope_type {kind!r} lacks {missing}; add them as the "
                              "model's original config.json has them")  # fmt: skip
    heads = need("num_attention_heads")
    return dict(
        num_layers=need("num_hidden_layers"),
        hidden=need("hidden_size"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or need("hidden_size") // heads,
        mlp=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        qkv_share_every=1,
        norm="rmsnorm",
        mlp_activation="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=dict(
            type=ROPE_TYPES[kind],
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_len=int(rope.get("original_max_position_embeddings", 8192)),
        ),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def check_llama(model: ModelConfig, expand_shared_qkv: bool = False) -> None:
    """Refuses a model the Llama architecture cannot express, naming the field. With
    `expand_shared_qkv`, a shared QKV is allowed: each layer gets its group's copy."""
    fix = "the Llama architecture has no other; such a model cannot be written as a LlamaForCausalLM"
    if model.norm != "rmsnorm":
        raise ConversionError(f"model.norm={model.norm!r}: Llama normalises with RMSNorm; {fix}")
    if model.mlp_activation != "swiglu":
        raise ConversionError(f"model.mlp_activation={model.mlp_activation!r}: Llama's MLP is SwiGLU; {fix}")
    if model.quantize is not None and not model.lora.rank:
        raise ConversionError(f"model.quantize={model.quantize!r}: convert the full-precision run or export")
    if model.qkv_share_every > 1 and not expand_shared_qkv:
        raise ConversionError(
            f"model.qkv_share_every={model.qkv_share_every}: Llama has its own q/k/v in every layer; pass "
            "--expand-shared-qkv to write each group's q/k/v into every layer of the group (an exact Llama "
            "with more parameters)"
        )


def hf_config(model: ModelConfig, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """The `config.json` of `model` as a LlamaForCausalLM (see `check_llama`), weights in `dtype`."""
    s, scaling = model, model.rope_scaling
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if scaling.type != "none":
        rope.update(rope_type=scaling.type, factor=scaling.factor)
    if scaling.type == "llama3":
        rope.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                    original_max_position_embeddings=scaling.original_max_len)  # fmt: skip
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if scaling.type != "none" else None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.hidden,
        "intermediate_size": model.mlp,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,  # read by transformers 4 (and, converted, by 5)
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope,  # transformers 5's own
        "max_position_embeddings": model.max_seq_len,
        "vocab_size": model.vocab_size,
        "tie_word_embeddings": bool(model.tie_embeddings),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,  # transformers 4's name
        "dtype": dtype,  # and 5's
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def fine_tuning_config(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """`cfg` made to fine-tune the Llama at `cfg.init.hf`: its architecture from its config.json
    (a command-line override that disagrees is refused), its tokenizer, and prepared data of its
    own (`data.dir` gains the model's name unless overridden). `overrides`: the dotted fields the
    command line set."""
    hf = require_hf_dir(cfg.init.hf, "--config.init.hf")
    fields = model_fields(read_json(hf / "config.json"), str(hf / "config.json"))
    flat = {f"model.{k}": v for k, v in fields.items() if k != "rope_scaling"}
    flat |= {f"model.rope_scaling.{k}": v for k, v in fields["rope_scaling"].items()}
    for name, value in overrides.items():
        if name in flat and value != flat[name]:
            raise ConversionError(f"--config.{name}={value!r} conflicts with {hf / 'config.json'}, which gives "
                                  f"{flat[name]!r}: the weights have that architecture; drop the override")  # fmt: skip
    if "data.tokenizer" in overrides:
        raise ConversionError(f"--config.data.tokenizer: init.hf fine-tunes with the model's own tokenizer "
                              f"({hf / 'tokenizer.json'}); drop the override")  # fmt: skip
    if not (hf / "tokenizer.json").is_file():
        raise ConversionError(f"init.hf={hf} has no tokenizer.json; fine-tuning needs the model's own tokenizer")
    data = {"tokenizer": str(hf / "tokenizer.json")}
    if "data.dir" not in overrides:
        data["dir"] = f"{cfg.data.dir}-{hf.name}"
    return cfg.updated(model=fields, init=dict(hf=str(hf)), data=data)
