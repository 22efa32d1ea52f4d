"""A Hugging Face Llama directory as a source (its config as a jaxllm config, its weights into any
mesh) and as a destination (config.json, safetensors, generation_config.json and the tokenizer's
files, as transformers, vLLM and TGI load them)."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable

import jax

from jaxllm.checkpoint.hf.config import ConversionError, hf_config, model_fields, read_json
from jaxllm.checkpoint.hf.files import SAFETENSORS_DTYPES, WeightFiles
from jaxllm.checkpoint.hf.tensors import read_params, rules, write_hf_weights
from jaxllm.config import ModelConfig, RunConfig
from jaxllm.data.tokenizer import HFTokenizer, Tokenizer

DTYPES = {code: name for name, code in SAFETENSORS_DTYPES.items()}


def stored_hf_config(path: str | pathlib.Path) -> RunConfig:
    """A full jaxllm config for the Llama at `path`: its architecture from config.json, its
    params stored in its weights' dtype, its own tokenizer, everything else the defaults."""
    path = pathlib.Path(path)
    fields = model_fields(read_json(path / "config.json"), str(path / "config.json"))
    files = WeightFiles(path)
    stored = files.dtype.get("model.embed_tokens.weight")
    if stored not in DTYPES:
        raise ConversionError(f"{path}: model.embed_tokens.weight is stored as {stored}; jaxllm reads weights "
                              f"stored as {sorted(DTYPES)}")  # fmt: skip
    return RunConfig().updated(model=fields | {"param_dtype": DTYPES[stored]},
                               data=dict(tokenizer=str(path / "tokenizer.json")))  # fmt: skip


def read_hf_params(path: str | pathlib.Path, model: ModelConfig, target: dict) -> dict:
    """The Llama's weights at `path` as params shaped, sharded and typed as `target`."""
    return read_params(WeightFiles(path), model, target)


def write_hf(
    out: str | pathlib.Path,
    model: ModelConfig,
    parameter: Callable[[tuple[str, ...]], jax.Array],
    tokenizer: Tokenizer | None,
    dtype: str,
    max_shard_bytes: int,
) -> list[pathlib.Path]:
    """Writes `model` (see `check_llama`) as a Llama directory with the tokenizer's files (if it
    has a tokenizer), its params asked of `parameter` one at a time (see `write_hf_weights`);
    returns the weight files."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = write_hf_weights(out, parameter, model, dtype, max_shard_bytes)
    ids = (None, None) if tokenizer is None else (tokenizer.bos_id, tokenizer.eos_id)
    (out / "config.json").write_text(json.dumps(hf_config(model, dtype, *ids), indent=2))
    if tokenizer is None:
        return files
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(out)  # tokenizer.json with the tokenizer_config.json etc. it came with
        _write_absent(out / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.decode([tokenizer.bos_id]),
            "eos_token": tokenizer.decode([tokenizer.eos_id]), "model_max_length": model.max_seq_len,
        })  # fmt: skip
    _write_absent(out / "generation_config.json", {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id})
    return files


def _write_absent(path: pathlib.Path, contents: dict) -> None:
    if not path.exists():
        path.write_text(json.dumps(contents, indent=2))


def expanded_qkv_parameters(model: ModelConfig) -> int:
    """Parameters that writing each group's shared q/k/v into every layer of the group adds."""
    per_layer = sum(math.prod(r.hf_shape) for r in rules(model) if r.stack == "groups")
    return per_layer * (model.num_layers - model.groups)
