"""INT8 serving on a small model trained on real text (the stdlib's json sources, a 300-token BPE):
weights quantized by the stated formula and sharded by the rules table; int8 logits close to bf16
and greedy generations that mostly agree; an int8 export that reads back bit for bit; an int8 KV
cache whose attention equals attention over its dequantized entries, and whose decode stays close
to a bf16 cache's."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.runs import small_config, stdlib_glob
from support.xla_flags import DEFAULT_COMPILE

from jaxllm import plan
from jaxllm.checkpoint import load_params
from jaxllm.config import ConfigError
from jaxllm.data.corpus import read_documents, resolve_inputs
from jaxllm.data.tokenizer import get_tokenizer, save_tokenizer, train_bpe
from jaxllm.export import export
from jaxllm.model.cache import Int8, KVCache
from jaxllm.model.decoder import Model
from jaxllm.model.int8 import quantize_weight, symmetric_int8
from jaxllm.model.layers import attend
from jaxllm.parallel.mesh import make_mesh
from jaxllm.serve.generation import Request
from jaxllm.serve.load import load_engine, serving_setup
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_train_step, init_state

VOCAB, SEQ, STEPS = 300, 64, 150
SERVE = {"model.max_seq_len": 128, "serve.max_len": 96, "serve.max_prompt_tokens": 16, "serve.slots": 4,
         "serve.dtype": "bfloat16"}  # fmt: skip
PROMPTS = ["import json\n", "    def __init__(self", "        if ", "class JSONDecoder("]
# Stated tolerances, against bf16 serving of the same checkpoint (whose own distance from fp32 is
# printed beside them): int8 weights move a log-prob by at most LOGPROB_ATOL, an int8 KV cache by
# at most KV_ATOL, at every position and token of the validation text.
LOGPROB_ATOL, KV_ATOL = 0.2, 0.15


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """150 steps on windows of the json package's sources, checkpointed as a run does."""
    workdir = tmp_path_factory.mktemp("run")
    texts = [text for f in resolve_inputs([stdlib_glob("json")]) for _, text in read_documents(f)]
    tokenizer = get_tokenizer(train_bpe(iter(texts), VOCAB, workdir / "bpe"))
    save_tokenizer(tokenizer, workdir / "tokenizer")
    ids = np.concatenate([tokenizer.encode(t) for t in texts]).astype(np.int32)
    cfg = small_config(vocab_size=VOCAB, max_seq_len=SEQ)
    cfg = cfg.updated(train=dict(seq_len=SEQ, steps=STEPS, warmup_steps=10))
    mesh, rng = make_mesh(cfg.parallel, jax.devices()[:1]), np.random.default_rng(0)

    def batch():
        starts = rng.integers(0, len(ids) - SEQ - 1, cfg.train.batch_size)
        w = np.stack([ids[s : s + SEQ + 1] for s in starts])
        return jax.device_put({"inputs": w[:, :-1], "targets": w[:, 1:]}, batch_sharding(mesh))

    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state, first = init_state(run), batch()
        # 150 steps run longer than they compile: this one program gets XLA's default optimization
        step = compile_train_step(run).lower(state, first).compile(compiler_options=DEFAULT_COMPILE)
        for i in range(STEPS):
            state, _ = step(state, first if i == 0 else batch())
        checkpoints = run.checkpointer(workdir)
        checkpoints.save(STEPS, state, {})
        checkpoints.close()
    return workdir, tokenizer, ids[-4 * SEQ :].reshape(4, SEQ)  # the last windows, for log-probs


def _logprobs(params, model, tokens, kv_dtype=None):
    """Every position's log-probs, teacher-forced; with `kv_dtype`, through a KV cache one token at
    a time after a 16-token prefill, as decoding reads it."""
    if kv_dtype is None:
        return jax.nn.log_softmax(Model(model).logits(params, tokens)[..., :VOCAB])
    cache = KVCache.empty(model, tokens.shape[0], tokens.shape[1], kv_dtype)
    logits, cache = Model(model).prefill(params, tokens[:, :16], cache)
    step = jax.jit(lambda params, token, at, cache: Model(model).decode_step(params, token, at, cache))
    out = [logits]
    for i in range(16, tokens.shape[1]):
        logits, cache = step(params, tokens[:, i : i + 1], jnp.full((tokens.shape[0], 1), i), cache)
        out.append(logits)
    return jax.nn.log_softmax(jnp.concatenate(out, axis=1)[..., :VOCAB])


def test_weights_follow_the_formula_and_shard_by_the_rules(trained):
    """Per output channel, scale = max|W| over the contracted axes / 127 and q = round(W / scale);
    on tensor 2, a column-parallel scale splits with its output channels and a row-parallel one
    is replicated, with no rule of its own. The planner's int8 bytes are what the server holds."""
    w = np.random.default_rng(0).normal(size=(6, 4, 5)).astype(np.float32)
    got = quantize_weight(jnp.asarray(w), (0, 1))  # an o_proj: heads and head_dim are contracted
    scale = np.abs(w).max(axis=(0, 1)) / 127
    np.testing.assert_array_equal(got["q"], np.round(w / scale).astype(np.int8))
    np.testing.assert_allclose(got["scale"], scale, rtol=2e-7)  # ÷ 127 may run as × (1 / 127)
    cfg, _ = serving_setup(trained[0], {**SERVE, "serve.tensor": 2})
    mesh = make_mesh(cfg.parallel, jax.devices()[:2])
    _, params, _ = load_params(trained[0], mesh, "bfloat16", quantize="int8")
    groups = params["groups"]
    assert groups["qkv"]["q"]["q"].dtype == jnp.int8 and groups["qkv"]["q"]["scale"].dtype == jnp.float32
    assert groups["qkv"]["q"]["scale"].sharding.spec == P(None, "tensor")  # [groups, heads, head_dim]
    assert groups["layers"]["mlp"]["up"]["scale"].sharding.spec == P(None, None, "tensor")  # [.., mlp]
    assert groups["layers"]["o_proj"]["scale"].sharding.is_fully_replicated  # [.., embed]
    assert groups["layers"]["mlp"]["down"]["scale"].sharding.is_fully_replicated
    assert params["embed"].dtype == jnp.bfloat16  # the embedding and head are not projections
    planned = plan.weight_bytes(cfg.model)
    assert planned["int8 as served"] == sum(a.nbytes for a in jax.tree.leaves(params))
    weights = [a for a in jax.tree.leaves(params) if a.dtype != jnp.float32]  # all but the int8 scales
    assert planned["int8"] == planned["bf16"] / 2 == sum(a.size for a in weights)


def test_int8_logits_and_greedy_tokens_stay_close_to_bf16(trained):
    """Teacher-forced log-probs within LOGPROB_ATOL of bf16 serving; through the engine (int8 on
    tensor 2, its row-parallel scales applied after the psum), at least 56 of 64 greedy tokens
    equal bf16's on each of four prompts."""
    workdir, tokenizer, val = trained
    cfg, _ = serving_setup(workdir, SERVE)
    int8_cfg, _ = serving_setup(workdir, {**SERVE, "model.quantize": "int8"})
    bf16 = _logprobs(load_params(workdir, dtype="bfloat16")[1], cfg.model, val)
    int8 = _logprobs(load_params(workdir, dtype="bfloat16", quantize="int8")[1], int8_cfg.model, val)
    fp32_model = cfg.model.replace(dtype="float32")
    fp32 = _logprobs(load_params(workdir)[1], fp32_model, val)
    error = float(jnp.abs(int8 - bf16).max())
    print(f"max |Δ log-prob|: int8 vs bf16 {error:.4f}, bf16 vs fp32 {float(jnp.abs(bf16 - fp32).max()):.4f}")
    assert 1e-3 < error < LOGPROB_ATOL  # int8 did change the weights, and by little
    requests = [Request(tokenizer.encode(p), max_tokens=64, temperature=0, ignore_eos=True) for p in PROMPTS]
    runs = {
        q: [g.choices()[0].tokens for g in load_engine(workdir, {**SERVE, **extra}).generate(requests)]
        for q, extra in (("bf16", {}), ("int8", {"model.quantize": "int8", "serve.tensor": 2}))
    }
    equal = [int(np.sum(np.equal(a, b))) for a, b in zip(runs["bf16"], runs["int8"], strict=True)]
    print("greedy tokens equal to bf16's, of 64:", equal)
    assert min(equal) >= 56, equal


def test_int8_export_reads_back_as_quantized_at_load(trained, tmp_path):
    """`export --quantize int8` writes int8 weights and says so in its config; read back, they
    equal quantizing the run's params at load, bit for bit; the export serves only as int8."""
    workdir = trained[0]
    export(workdir, tmp_path / "int8", quantize="int8")
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["model"]["quantize"] == "int8"
    exported = load_params(tmp_path / "int8", dtype="bfloat16")[1]
    at_load = load_params(workdir, dtype="bfloat16", quantize="int8")[1]
    assert exported["groups"]["layers"]["mlp"]["down"]["q"].dtype == jnp.int8
    jax.tree.map(np.testing.assert_array_equal, exported, at_load)
    with pytest.raises(ConfigError, match="holds int8 weights, which serve only as int8"):
        serving_setup(tmp_path / "int8", {"model.quantize": None})


def test_int8_kv_attention_equals_attention_over_dequantized_entries():
    """Scales applied to scores (keys) and probabilities (values) equal attending over q × scale;
    each token's and head's scale is max|k| over head_dim / 127."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 3, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)))
    mask = jnp.asarray(rng.random((2, 1, 3, 5)) < 0.8)
    k8, v8 = (Int8(*symmetric_int8(a, (-1,), keepdims=True)) for a in (k, v))
    np.testing.assert_allclose(k8.scale[..., 0], np.abs(np.asarray(k)).max(-1) / 127, rtol=2e-7)
    dequantized = [e.q.astype(jnp.float32) * e.scale for e in (k8, v8)]
    want = attend(q, *dequantized, mask, kv_layout="bksd")
    np.testing.assert_allclose(attend(q, k8, v8, mask, kv_layout="bksd"), want, rtol=1e-5, atol=1e-6)


def test_int8_kv_decode_stays_close_to_a_bf16_cache(trained):
    """Decoding the validation text through an int8 cache: every log-prob within KV_ATOL of a
    bf16 cache's (bf16 weights both), and the cache takes (head_dim + 4) / (2 head_dim) of the bytes."""
    workdir, _, val = trained
    cfg, _ = serving_setup(workdir, SERVE)
    params = load_params(workdir, dtype="bfloat16")[1]
    bf16, int8 = (_logprobs(params, cfg.model, val, kv) for kv in ("bfloat16", "int8"))
    error = float(jnp.abs(int8 - bf16).max())
    print(f"max |Δ log-prob| int8 vs bf16 KV cache: {error:.4f}")
    assert 1e-3 < error < KV_ATOL
    nbytes = {
        kv: sum(a.nbytes for a in jax.tree.leaves(KVCache.empty(cfg.model, 1, 8, kv)[:2]))
        for kv in ("bfloat16", "int8")
    }
    head_dim = cfg.model.hidden // cfg.model.num_heads
    assert nbytes["int8"] / nbytes["bfloat16"] == (head_dim + 4) / (2 * head_dim)
