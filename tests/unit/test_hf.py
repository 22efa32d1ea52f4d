"""Hugging Face Llama interop. Always: hand-built safetensors Llamas (names, shapes and config.json
written here, not by jaxllm) imported and run against an independent numpy Llama; export → import
bit-exact; the refusals; host memory while converting ~200 MB; `serve --hf` through the OpenAI
client; fine-tuning's config and its initial state on a pipeline mesh. With the `hf` extra
(torch + transformers): transformers' own LlamaForCausalLM both ways."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from flax import nnx
from support.hf import hf_extra
from support.llama_files import (
    BASE,
    CHAT,
    GQA_LLAMA3,
    MHA_TIED_BF16,
    bpe_tokenizer,
    hand_built,
    with_tokenizer,
)
from support.numpy_llama import logits
from support.runs import small_config

from jaxllm.checkpoint import load_params, write_export
from jaxllm.checkpoint.hf.config import ConversionError, check_llama, fine_tuning_config
from jaxllm.checkpoint.layout import to_canonical
from jaxllm.config import ParallelConfig, RunConfig, validate
from jaxllm.convert import from_hf, to_hf
from jaxllm.data.chat import ChatTemplate
from jaxllm.data.tokenizer import TokenizerError, get_tokenizer, save_tokenizer
from jaxllm.model.decoder import Decoder, Model
from jaxllm.model.generate import generate
from jaxllm.model.lora import adapter_mask, combine, partition
from jaxllm.model.params import params_of
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.dry_run import lower_abstract_step
from jaxllm.train.run import build_run
from jaxllm.train.step import compile_eval_step, init_state


def our_logits(path, tokens, mesh=None) -> np.ndarray:
    cfg, params, _ = load_params(path, mesh)
    cfg = cfg.updated(model=dict(dtype="float32"))
    return np.asarray(Model(cfg.model).logits(params, tokens))[..., : cfg.model.vocab_size]


TOKENS = np.random.default_rng(1).integers(0, BASE["vocab"], (2, 24))


@pytest.mark.parametrize("case", [GQA_LLAMA3, MHA_TIED_BF16], ids=["gqa-untied-llama3-sharded", "mha-tied-bf16"])
def test_imported_llama_computes_what_a_numpy_llama_computes(tmp_path, case):
    config, tensors = hand_built(tmp_path / "hf", **case)
    ref = logits(tensors, config, TOKENS)
    assert ref.std() > 1  # logits that tell tokens apart, so a swapped head or rotation shows
    np.testing.assert_allclose(our_logits(tmp_path / "hf", TOKENS), ref, rtol=2e-4, atol=2e-4)


def test_sharded_import_fills_each_device_with_its_slice(tmp_path):
    hand_built(tmp_path / "hf")
    mesh = make_mesh(ParallelConfig(data=1, fsdp=2, tensor=4))
    _, whole, _ = load_params(tmp_path / "hf")
    _, split, _ = load_params(tmp_path / "hf", mesh)
    assert not split["embed"].sharding.is_fully_replicated  # vocab over tensor: a shard straddles 300 of 384
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), whole, split)


def test_hf_to_jaxllm_to_hf_gives_back_the_same_tensors(tmp_path, capsys):
    """A weights-only directory (config.json and safetensors, no tokenizer) goes both ways: back
    come the same tensors and config, and no tokenizer files, with a note that says so."""
    config, tensors = hand_built(tmp_path / "hf", **MHA_TIED_BF16)
    from_hf(tmp_path / "hf", tmp_path / "export")
    to_hf(tmp_path / "export", tmp_path / "back")
    assert "holds no tokenizer, so" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "back").iterdir()} == {"config.json", "model.safetensors"}
    back = safetensors.numpy.load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and np.array_equal(back[name], tensor), name
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    fields = ("num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters")  # θ and linear scaling
    assert {k: written[k] for k in fields} == {k: config[k] for k in fields}


def own_export(directory: pathlib.Path, **model) -> RunConfig:
    """A jaxllm export of a random model (vocab 257, padded to 384), with a trained BPE tokenizer."""
    cfg = small_config(**{"qkv_share_every": 1, "init_std": 0.3, **model})
    params = params_of(Decoder(cfg.model, rngs=nnx.Rngs(3)))
    write_export(directory, cfg, params, 7)
    save_tokenizer(get_tokenizer(bpe_tokenizer(directory.parent)), directory / "tokenizer")
    return cfg


def test_export_then_import_is_bit_exact_and_drops_the_vocab_padding(tmp_path):
    cfg = own_export(tmp_path / "export")
    to_hf(tmp_path / "export", tmp_path / "hf", max_shard_bytes=100_000)
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= files
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2 and set(weight_map.values()) <= files
    head = safetensors.numpy.load_file(tmp_path / "hf" / weight_map["lm_head.weight"])["lm_head.weight"]
    assert head.shape == (cfg.model.vocab_size, cfg.model.hidden)
    from_hf(tmp_path / "hf", tmp_path / "again")
    _, before, _ = load_params(tmp_path / "export")
    _, after, _ = load_params(tmp_path / "again")
    vocab = cfg.model.vocab_size
    before["embed"], before["lm_head"] = before["embed"][:vocab], before["lm_head"][:, :vocab]
    assert not np.asarray(after["embed"][vocab:]).any() and not np.asarray(after["lm_head"][:, vocab:]).any()
    after["embed"], after["lm_head"] = after["embed"][:vocab], after["lm_head"][:, :vocab]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), before, after)


def test_expanded_shared_qkv_is_an_exact_llama(tmp_path, capsys):
    cfg = own_export(tmp_path / "export", qkv_share_every=2, num_layers=4)
    with pytest.raises(ConversionError, match=r"model.qkv_share_every=2: .* pass --expand-shared-qkv"):
        to_hf(tmp_path / "export", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    to_hf(tmp_path / "export", tmp_path / "hf", expand_shared_qkv=True)
    with pytest.raises(ConversionError, match="is not empty; pass a new directory"):  # old files would mix in
        to_hf(tmp_path / "export", tmp_path / "hf", expand_shared_qkv=True)
    with pytest.raises(ConversionError, match="is already a Hugging Face directory"):
        to_hf(tmp_path / "hf", tmp_path / "again")
    m = cfg.model  # every layer past its group's first gets its own q, k and v
    extra = m.hidden * (m.num_heads + 2 * m.num_kv_heads) * (m.hidden // m.num_heads) * (m.num_layers - 2)
    assert f"an exact Llama with {extra:,} more parameters" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    tensors = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    for name in ("q_proj", "k_proj", "v_proj"):  # layers 0 and 1 share group 0's
        assert np.array_equal(tensors[f"model.layers.0.self_attn.{name}.weight"],
                              tensors[f"model.layers.1.self_attn.{name}.weight"])  # fmt: skip
    tokens = TOKENS % cfg.model.vocab_size
    np.testing.assert_allclose(our_logits(tmp_path / "export", tokens), logits(tensors, config, tokens), rtol=1e-4,
                               atol=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    "model, pattern",
    [
        (dict(mlp_activation="geglu"), r"model.mlp_activation='geglu': Llama's MLP is SwiGLU"),
        (dict(mlp_activation="gelu"), r"model.mlp_activation='gelu'"),
        (dict(norm="layernorm"), r"model.norm='layernorm': Llama normalises with RMSNorm"),
    ],
)
def test_a_model_llama_cannot_express_is_refused_by_field(tmp_path, model, pattern):
    own_export(tmp_path / "export", **model)
    with pytest.raises(ConversionError, match=pattern):
        to_hf(tmp_path / "export", tmp_path / "hf", expand_shared_qkv=True)


def test_int8_weights_are_refused():
    cfg = small_config(qkv_share_every=1)
    cfg = cfg.updated(model=dict(quantize="int8"))
    with pytest.raises(ConversionError, match="model.quantize='int8': convert the full-precision run"):
        check_llama(cfg.model)


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling.rope_type='yarn' is not implemented"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not SwiGLU's silu"),
        (dict(attention_bias=True), r"attention_bias=True adds biases"),
        (dict(model_type="gpt2"), r"model_type='gpt2' is not a Llama model"),
        (dict(intermediate_size=64), r"model.layers.0.mlp.down_proj.weight has shape \(48, 96\), config.json implies"),
        (dict(num_hidden_layers="2"), r"num_hidden_layers='2' must be a positive integer"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"lacks \['low_freq_factor'"),
        (dict(tie_word_embeddings=True, extra=True), r"unexpected model.extra"),
    ],
)
def test_an_hf_directory_that_cannot_be_read_is_refused_by_field(tmp_path, change, pattern):
    config, _ = hand_built(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    if change.get("extra"):  # a tied model may keep its head in the file; anything else is refused
        add_tensor(tmp_path / "hf", "model.extra", np.zeros(2, np.float32))
    with pytest.raises(ConversionError, match=pattern):
        load_params(tmp_path / "hf")


def add_tensor(directory: pathlib.Path, name: str, tensor: np.ndarray) -> None:
    safetensors.numpy.save_file({name: tensor}, directory / "extra.safetensors")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "extra.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_tied_model_that_stores_its_head_too_loads(tmp_path):
    config, tensors = hand_built(tmp_path / "hf", tied=True)
    add_tensor(tmp_path / "hf", "lm_head.weight", tensors["model.embed_tokens.weight"])
    np.testing.assert_allclose(our_logits(tmp_path / "hf", TOKENS), logits(tensors, config, TOKENS), rtol=2e-4,
                               atol=2e-4)  # fmt: skip


def test_a_missing_or_corrupt_shard_is_named(tmp_path):
    hand_built(tmp_path / "hf")
    shard = tmp_path / "hf" / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConversionError, match="model-00002-of-00003.safetensors is not a readable safetensors file"):
        load_params(tmp_path / "hf")
    shard.unlink()
    with pytest.raises(ConversionError, match="model-00002-of-00003.safetensors is missing"):
        load_params(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")  # a stale single file beside the index
    with pytest.raises(ConversionError, match="has both model.safetensors and model.safetensors.index.json"):
        load_params(tmp_path / "hf")
    for weights in (tmp_path / "hf").glob("model*"):  # what a PyTorch-only download leaves
        weights.unlink()
    with pytest.raises(ConversionError, match=r"neither .* save_pretrained\(DIR, safe_serialization=True\)"):
        load_params(tmp_path / "hf")


def test_a_models_tokenizer_files_give_its_special_tokens_stops_and_chat_template(tmp_path):
    hand_built(tmp_path / "hf")
    with_tokenizer(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "export")
    for directory in (tmp_path / "hf", tmp_path / "export" / "tokenizer"):  # the export keeps the files
        tokenizer = get_tokenizer(directory)
        assert tokenizer.decode([tokenizer.bos_id]) == "<|pad|>" and tokenizer.decode([tokenizer.eos_id]) == (
            "<|endoftext|>"
        )
        assert tokenizer.stop_ids == {tokenizer.eos_id, 7} and tokenizer.chat_template == CHAT
        assert tokenizer.prompt_prefix == (tokenizer.bos_id,) and tokenizer.encode("a")[0] != tokenizer.bos_id
    assert get_tokenizer(bpe_tokenizer(tmp_path)).prompt_prefix == ()  # no post-processor: nothing before a prompt


# Blocks on lines of their own and a {% break %}: transformers trims those lines and has loop controls.
OWN_TEMPLATE = (
    "{% for m in messages %}\n  {{ m.role }}: {{ m.content }}\n{% if loop.last %}{% break %}{% endif %}\n{% endfor %}\n"
)


@pytest.mark.parametrize("declared", ["tokenizer_config", "generation_config", "neither"])
def test_special_tokens_come_from_the_files_that_declare_them(tmp_path, declared):
    """An end-of-text token of any name (here <|im_end|>, as Qwen and ChatML name theirs) is the
    one tokenizer_config.json's eos_token or generation_config.json's eos_token_id names; with
    neither, and no usual name in the vocabulary, the tokenizer is refused, naming both files."""
    directory = tmp_path / "tok"
    directory.mkdir()
    tok = tokenizers.Tokenizer.from_file(str(bpe_tokenizer(tmp_path)))
    vocab = tok.get_vocab()
    rename = {"<|endoftext|>": "<|im_end|>", "<|pad|>": "<|im_start|>"}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({rename.get(t, t): i for t, i in vocab.items()}, []))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in rename.values()])
    tok.save(str(directory / "tokenizer.json"))
    end, start = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    if declared == "tokenizer_config":
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    if declared == "generation_config":
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": end, "bos_token_id": start}))
    if declared == "neither":
        with pytest.raises(TokenizerError, match="no end-of-text token: name it as eos_token in tokenizer_config"):
            get_tokenizer(directory)
        return
    tokenizer = get_tokenizer(directory)
    assert tokenizer.eos_id == end and end in tokenizer.stop_ids
    assert tokenizer.bos_id == (start if declared == "generation_config" else end)


def test_a_models_own_chat_template_renders_as_transformers_renders_it(tmp_path):
    hand_built(tmp_path / "hf")
    with_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "chat_template.jinja").write_text(OWN_TEMPLATE)  # takes precedence, as in transformers
    own = get_tokenizer(tmp_path / "hf").chat_template
    assert own == OWN_TEMPLATE
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert ChatTemplate.chosen(None, own, {}).render(messages) == "  user: a\n  assistant: b\n"


def test_fine_tuning_config_takes_the_architecture_and_refuses_a_conflicting_override(tmp_path):
    config, _ = hand_built(tmp_path / "hf")
    with_tokenizer(tmp_path / "hf")
    cfg = RunConfig().updated(init=dict(hf=str(tmp_path / "hf")))
    tuned = fine_tuning_config(cfg, {"model.remat": "full", "model.num_heads": 4})
    assert (tuned.model.hidden, tuned.model.num_kv_heads, tuned.model.qkv_share_every) == (48, 2, 1)
    assert tuned.model.rope_scaling.type == "llama3" and tuned.model.rope_theta == config["rope_theta"]
    assert tuned.data.tokenizer == str(tmp_path / "hf" / "tokenizer.json")
    assert tuned.data.dir == f"{cfg.data.dir}-hf"
    with pytest.raises(ConversionError, match=r"--config.model.hidden=64 conflicts with .*config.json, which gives 48"):
        fine_tuning_config(cfg, {"model.hidden": 64})
    with pytest.raises(ConversionError, match=r"--config.model.rope_scaling.factor=2.0 conflicts"):
        fine_tuning_config(cfg, {"model.rope_scaling.factor": 2.0})
    with pytest.raises(ConversionError, match="--config.data.tokenizer: init.hf fine-tunes with the model's own"):
        fine_tuning_config(cfg, {"data.tokenizer": "gpt2"})
    for weights in (tmp_path / "hf").glob("model*.safetensors"):
        weights.unlink()  # the dry run's lowering takes shapes alone: it reads no weights
    tuned = tuned.updated(parallel=dict(data=8))
    lower_abstract_step(tuned, make_mesh(tuned.parallel))


def test_fine_tuning_starts_from_the_llama_on_a_pipeline_mesh(tmp_path):
    """data 2 × stage 2 × tensor 2: the initial params are the Llama's, the optimizer is fresh,
    and the pipelined loss equals the numpy Llama's."""
    config, tensors = hand_built(tmp_path / "hf")
    with_tokenizer(tmp_path / "hf")
    cfg = fine_tuning_config(RunConfig().updated(init=dict(hf=str(tmp_path / "hf"))), {})
    cfg = cfg.updated(
        model=dict(dtype="float32"),
        parallel=dict(data=2, fsdp=1, stage=2, tensor=2, microbatches=2),
        train=dict(batch_size=4, seq_len=16),
    )
    validate(cfg, 8)
    run = build_run(cfg, make_mesh(cfg.parallel))
    with jax.set_mesh(run.mesh):
        state = init_state(run)
        tokens = TOKENS[:, :17].repeat(2, 0)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        batch = jax.device_put(batch, run.batch_sharding)
        total, count = compile_eval_step(run)(state["params"], batch)
    _, imported, _ = load_params(tmp_path / "hf")
    canonical = to_canonical(state["params"], run.schedule)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), canonical, imported)
    assert int(state["step"]) == 0 and not any(np.asarray(m).any() for m in jax.tree.leaves(state["opt_state"]))
    logp = logits(tensors, config, tokens[:, :-1])
    logp = (
        logp - np.log(np.exp(logp - logp.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logp.max(-1, keepdims=True)
    )
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    np.testing.assert_allclose(float(total / count), nll, rtol=1e-5)


try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None


needs_hf = hf_extra("torch", "transformers", "peft")


def transformers_llama(directory: pathlib.Path, dtype="float32", max_shard_size="50GB", **config):
    """A random LlamaForCausalLM built and saved by transformers itself, in `dtype`, in files of at
    most `max_shard_size`; returned in float32 on the saved (rounded) weights."""
    torch.manual_seed(0)
    llama_config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, initializer_range=0.2, **config,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(llama_config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.to(getattr(torch, dtype)).save_pretrained(directory, max_shard_size=max_shard_size)
    return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def transformers_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


PROMPT_TEXT = "Bring a Llama: python -m jaxllm.convert from-hf"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip


@needs_hf
@pytest.mark.parametrize(
    "config",
    [dict(num_key_value_heads=4, tie_word_embeddings=False),
     dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=50000.0),
     dict(num_key_value_heads=2, rope_scaling=LLAMA3, max_shard_size="60KB"),
     dict(num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}, dtype="bfloat16")],
    ids=["mha-untied", "gqa-tied-theta", "gqa-llama3-sharded", "mha-linear-bf16"],
)  # fmt: skip
def test_transformers_llama_imports_with_equal_logits_and_greedy_tokens(tmp_path, config):
    model = transformers_llama(tmp_path / "hf", **config)
    if "max_shard_size" in config:
        assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    ref = transformers_logits(model, TOKENS)
    assert ref.std() > 1
    np.testing.assert_allclose(our_logits(tmp_path / "hf", TOKENS), ref, rtol=1e-4, atol=1e-4)
    prompt = TOKENS[0, :6]
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompt[None]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    cfg, params, _ = load_params(tmp_path / "hf")
    cfg = cfg.updated(model=dict(dtype="float32"))
    assert generate(params, Model(cfg.model), list(prompt), 16) == theirs[0].tolist()


@needs_hf
@pytest.mark.parametrize(
    "model,scaling",
    [(dict(), dict(type="llama3", factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_len=32)),
     (dict(tie_embeddings=True, num_kv_heads=2, rope_theta=5e4), dict(type="linear", factor=2.0)),
     (dict(qkv_share_every=2), dict(type="llama3", factor=4.0, original_max_len=32))],
    ids=["untied-llama3", "tied-gqa-theta-linear", "expanded-shared-qkv"],
)  # fmt: skip
def test_export_loads_in_transformers_with_equal_logits(tmp_path, model, scaling):
    cfg = own_export(tmp_path / "export", **model)
    cfg = cfg.updated(model=dict(rope_scaling=scaling))
    write_export(tmp_path / "export", cfg, load_params(tmp_path / "export")[1], 7)
    to_hf(tmp_path / "export", tmp_path / "hf", expand_shared_qkv=True)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = TOKENS % cfg.model.vocab_size
    np.testing.assert_allclose(transformers_logits(theirs, tokens), our_logits(tmp_path / "export", tokens),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    ours = get_tokenizer(tmp_path / "export" / "tokenizer")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").encode(PROMPT_TEXT) == ours.encode(PROMPT_TEXT)


@needs_hf
def test_a_models_tokenizer_files_read_as_transformers_reads_them(tmp_path):
    """bos before every prompt, the same ids and text, and generation_config's stop ids."""
    hand_built(tmp_path / "hf")
    with_tokenizer(tmp_path / "hf")
    ours = get_tokenizer(tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in (PROMPT_TEXT, "naïve café — 東京 <|endoftext|> tabs\tand\nlines"):
        ids = theirs.encode(text)
        assert ids == [*ours.prompt_prefix, *ours.encode(text)]
        assert theirs.decode(ids[1:]) == ours.decode(ids[1:])
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    stops = transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id
    assert set(stops) == ours.stop_ids


# A Llama 3.1-style template: tool calls as JSON (tojson keeps non-ASCII and <, >), trimmed blocks.
TOOL_TEMPLATE = """{{ bos_token }}{% for m in messages %}
{% if m.tool_calls is defined %}{{ m.role }}: {{ m.tool_calls | tojson }}
{% else %}{{ m.role }}: {{ m.content | trim }}{{ eos_token }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}assistant:{% endif %}"""


@needs_hf
@pytest.mark.parametrize("template", [OWN_TEMPLATE, TOOL_TEMPLATE, CHAT], ids=["loop-controls", "tojson", "plain"])
def test_a_models_own_chat_template_renders_as_transformers_renders_it_there(tmp_path, template):
    hand_built(tmp_path / "hf")
    with_tokenizer(tmp_path / "hf")
    messages = [
        {"role": "system", "content": "  Réponds en français. <b>&</b>  "},
        {"role": "user", "content": "Quel temps fait-il à 東京 ?"},
        {"role": "assistant", "tool_calls": [{"name": "météo", "arguments": {"ville": "東京", "unité": "<°C>"}}]},
    ]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    tokens = {"bos_token": theirs.bos_token, "eos_token": theirs.eos_token}
    ours = ChatTemplate(template, tokens, "the test's template", transformers_style=True)
    expected = theirs.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages) == expected


def lora_export(directory: pathlib.Path, base: RunConfig, params: dict, **lora) -> tuple[RunConfig, dict]:
    """An export of `base` with rank-4 LoRA adapters on `params`, each adapter random (a fresh one,
    b = 0, would hide a transposed or misplaced a·b); returns its config and its params."""
    cfg = base.updated(model=dict(lora=dict(rank=4, alpha=12.0, **lora)))
    fresh = Model(cfg.model).init(5)
    adapters, _ = partition(fresh, adapter_mask(Model(cfg.model).specs))
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda a: 0.2 * jax.random.normal(next(keys), a.shape, a.dtype), adapters)
    params = combine(jax.device_get(params), adapters)
    write_export(directory, cfg, params, 9)
    return cfg, params


def unmerged_logits(cfg: RunConfig, params: dict, tokens) -> np.ndarray:
    model = cfg.model.replace(dtype="float32")
    return np.asarray(Model(model).logits(params, tokens))[..., : model.vocab_size]


def test_a_lora_run_converts_merged_into_an_exact_llama(tmp_path, capsys):
    base = own_export(tmp_path / "base")
    cfg, params = lora_export(tmp_path / "export", base, load_params(tmp_path / "base")[1])
    shutil.copytree(tmp_path / "base" / "tokenizer", tmp_path / "export" / "tokenizer")
    to_hf(tmp_path / "export", tmp_path / "hf")
    tokens = TOKENS % cfg.model.vocab_size
    ours = unmerged_logits(cfg, params, tokens)
    assert np.abs(ours - unmerged_logits(base, load_params(tmp_path / "base")[1], tokens)).max() > 0.1
    np.testing.assert_allclose(our_logits(tmp_path / "hf", tokens), ours, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConversionError, match="--peft: .* has no LoRA adapters"):
        to_hf(tmp_path / "base", tmp_path / "peft", peft=True)


def test_a_lora_run_on_an_int8_base_converts_merged_into_a_llama_with_its_logits(tmp_path):
    base = own_export(tmp_path / "base")
    int8 = base.updated(model=dict(quantize="int8"))
    quantized = load_params(tmp_path / "base", quantize="int8")[1]
    cfg, params = lora_export(tmp_path / "export", int8, quantized, targets="q,v,down")  # k, o, gate, up bare
    shutil.copytree(tmp_path / "base" / "tokenizer", tmp_path / "export" / "tokenizer")
    to_hf(tmp_path / "export", tmp_path / "hf")
    tokens = TOKENS % cfg.model.vocab_size
    # The Llama holds each int8 weight dequantized, its adapter folded in: the run's own logits.
    np.testing.assert_allclose(our_logits(tmp_path / "hf", tokens), unmerged_logits(cfg, params, tokens),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    with pytest.raises(ConversionError, match="model.quantize='int8': convert the full-precision run"):
        check_llama(int8.model)  # without adapters an int8 run is a serving export, not a Llama


@needs_hf
def test_a_peft_adapter_export_loads_in_peft_with_equal_logits(tmp_path):
    import peft

    base = transformers_llama(tmp_path / "hf", num_key_value_heads=2)
    stored, params, _ = load_params(tmp_path / "hf")
    stored = stored.updated(init=dict(hf=str(tmp_path / "hf")))
    cfg, params = lora_export(tmp_path / "export", stored, params, targets="q,k,v,o,gate,up,down")
    to_hf(tmp_path / "export", tmp_path / "adapter", peft=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "hf") and config["r"] == 4
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    want = transformers_logits(theirs, TOKENS)
    with theirs.disable_adapter():
        assert np.abs(want - transformers_logits(theirs, TOKENS)).max() > 0.1  # the adapter applies
    np.testing.assert_allclose(unmerged_logits(cfg, params, TOKENS), want, rtol=1e-4, atol=1e-4)
