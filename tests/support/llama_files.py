"""Llama checkpoints as Hugging Face writes them, built here: config.json, random weights in
safetensors shards, a trained BPE with the tokenizer files a Llama ships. For the tests of import,
export and serving a Hugging Face directory."""

import json
import pathlib

import numpy as np
import safetensors.numpy
import tokenizers

from jaxllm.data.tokenizer import get_tokenizer, train_bpe
from support.runs import ROOT

BASE = dict(hidden=48, heads=4, kv=2, head_dim=16, layers=2, mlp=96, vocab=300)


# Wavelengths 2π/θ^(-2i/16) of 6.3, 24, 94, ... positions: with an original context of 64 the first
# pair is kept (< 64/4), the second ramps, the rest are divided by the factor.
GQA_LLAMA3 = dict(tied=False, theta=50000.0, dtype="float32", shards=3,
                  rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64})  # fmt: skip


# transformers 5 writes θ and the scaling together, as rope_parameters.
MHA_TIED_BF16 = dict(kv=4, tied=True, theta=10000.0, dtype="bfloat16", shards=1,
                     rope={"rope_type": "linear", "factor": 2.0}, rope_parameters=True)  # fmt: skip


def llama_config(hidden, heads, kv, head_dim, layers, mlp, vocab, tied, theta, rope, dtype, rope_parameters=False):
    """A Llama config.json as transformers 4 writes it, or 5 (`rope_parameters`)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": theta, "rope_scaling": rope, "max_position_embeddings": 64, "vocab_size": vocab,
        "tie_word_embeddings": tied, "torch_dtype": dtype, "bos_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    if rope_parameters:
        config["rope_parameters"] = {"rope_type": "default", **(config.pop("rope_scaling") or {}),
                                     "rope_theta": config.pop("rope_theta")}  # fmt: skip
    return config


def llama_tensors(config: dict, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under Llama's names, [out, in] matrices, norms near 1."""
    h, m, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads"))  # fmt: skip
    hd, vocab, rng = config["head_dim"], config["vocab_size"], np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                   p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                   p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                   p + "mlp.down_proj.weight": (h, m)}  # fmt: skip
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    return {
        name: ((1 + 0.1 * rng.standard_normal(shape)) if "norm" in name else 0.2 * rng.standard_normal(shape))
        .astype(np.float32)
        .astype(dtype)
        for name, shape in shapes.items()
    }


def write_llama(directory: pathlib.Path, config: dict, tensors: dict, shards: int) -> None:
    """config.json and the weights in `shards` files (with the index past one), by the safetensors library."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        safetensors.numpy.save_file(tensors, directory / "model.safetensors")
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        safetensors.numpy.save_file(part, directory / file)
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def hand_built(directory: pathlib.Path, **overrides) -> tuple[dict, dict]:
    spec = {**BASE, **GQA_LLAMA3, **overrides}
    shards = spec.pop("shards")
    config = llama_config(**spec)
    tensors = llama_tensors(config, spec["dtype"])
    write_llama(directory, config, tensors, shards)
    return config, tensors


def bpe_tokenizer(directory: pathlib.Path) -> pathlib.Path:
    path = directory / "bpe" / "tokenizer.json"
    if not path.exists():
        text = (ROOT / "README.md").read_text().split("\n\n")
        train_bpe(iter(text), 257, path.parent)
    return path


CHAT = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def with_tokenizer(directory: pathlib.Path) -> None:
    """A real BPE's tokenizer.json beside the weights, with the tokenizer_config.json (bos, eos,
    chat template) and generation_config.json (a second stop token) a Llama ships."""
    tokenizer = get_tokenizer(bpe_tokenizer(directory.parent))
    tokenizer.save(directory)
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))  # Llama's: bos before every text
    bos = tok.token_to_id("<|pad|>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|pad|> $A", special_tokens=[("<|pad|>", bos)]
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|pad|>", "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
         "chat_template": CHAT}))  # fmt: skip
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_id, 7]}))
