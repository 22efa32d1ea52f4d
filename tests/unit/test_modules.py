"""The Flax NNX modules: initial values frozen from the code before them, the plain-dict boundary,
Flax's own sharding view under our rules, checkpoints written before them, and the Flax snippet of
docs/model.md run as written."""

import hashlib
import json
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.docs import runnable_block
from support.runs import ROOT, small_config
from support.xla_flags import DEFAULT_COMPILE

from jaxllm.checkpoint import load_params, saved_config
from jaxllm.config import load_config
from jaxllm.export import export
from jaxllm.model import Decoder, Model, params_of
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import AXIS_RULES
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_train_step, init_params, init_state

FIXTURES = ROOT / "tests" / "support" / "fixtures"
# Per-parameter SHA-256 prefixes of the initial values that the pre-module code (commit 2d23323)
# gave these configs: seed 3 for the small model's options, seed 0 for configs/tiny.py.
GOLDEN = json.loads((FIXTURES / "init_checksums.json").read_text())
GOLDEN_CONFIGS = {  # the init code paths: weights, a norm bias, a cast, no separate head, the pipeline view
    "default": ({}, {}),
    "layernorm": ({"norm": "layernorm"}, {}),
    "bf16_params": ({"param_dtype": "bfloat16"}, {}),
    "tied": ({"tie_embeddings": True}, {}),
    "pipeline_S2_R2": ({"num_layers": 16}, {"stage": 2, "repeats": 2, "microbatches": 4, "schedule": "circular"}),
}


def digest(tree) -> dict[str, str]:
    def one(a):
        a = np.asarray(a)
        return hashlib.sha256(str((a.shape, a.dtype.name)).encode() + a.tobytes()).hexdigest()[:16]

    return {
        jax.tree_util.keystr(p, simple=True, separator="/"): one(a)
        for p, a in jax.tree_util.tree_leaves_with_path(tree)
    }


def at_default_compile(make):
    """`make()` compiled as users' processes compile it, not with the suite's quick flags, which
    change the last bits of the normal draws."""
    return jax.jit(make, compiler_options=DEFAULT_COMPILE)()


def _golden_config(name):
    if name == "tiny_seed0":
        return load_config("configs/tiny.py")
    model, parallel = GOLDEN_CONFIGS[name]
    cfg = small_config(**model)
    cfg = cfg.updated(parallel=parallel, train=dict(seed=3))
    return cfg


@pytest.mark.parametrize("name", [*GOLDEN_CONFIGS, "tiny_seed0"])
def test_init_equals_the_frozen_checksums(name):
    cfg = _golden_config(name)
    assert digest(at_default_compile(lambda: init_params(cfg))) == GOLDEN[name]


def test_module_init_ignores_rng_counters_and_equals_the_sharded_trainer_init():
    """`Decoder(model, rngs=nnx.Rngs(s), schedule=...)` after other draws from `rngs` holds the
    trainer's init with seed s, as initialised straight into the shards of an 8-device layout."""
    cfg = _golden_config("pipeline_S2_R2")
    cfg = cfg.updated(parallel=dict(data=2, fsdp=2))
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        sharded = jax.device_get(init_state(build_run(cfg, mesh))["params"])
    rngs = nnx.Rngs(cfg.train.seed)
    rngs.params(), rngs()  # draws before construction change no initial value
    module = Decoder(cfg.model, rngs=rngs, schedule=cfg.parallel.pipeline)
    chex.assert_trees_all_equal(params_of(module), sharded)


def test_params_are_a_plain_dict_and_round_trip_through_the_model():
    cfg = small_config()
    module = Decoder(cfg.model, rngs=nnx.Rngs(3))
    params = params_of(module)
    # today's keys (the checkpoint schema) and values
    assert digest(at_default_compile(lambda: params_of(Decoder(cfg.model, rngs=nnx.Rngs(3))))) == GOLDEN["default"]
    assert all(type(node) is dict for node in _nodes(params)), "plain dicts only, no nnx.State"
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))
    again = Model(cfg.model).bind(params)
    chex.assert_trees_all_equal(params_of(again), params)
    tokens = jnp.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(again(tokens), module(tokens))


def _nodes(tree):
    yield tree
    for value in tree.values():
        if isinstance(value, dict):
            yield from _nodes(value)


def test_binding_params_names_what_does_not_fit():
    cfg = small_config()
    params = params_of(nnx.eval_shape(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"unexpected lm_head.*Pass the config they were saved with"):
        Model(small_config(tie_embeddings=True).model).bind(params)
    with pytest.raises(ValueError, match=r"embed has shape \(384, 64\), the model needs \(384, 128\)"):
        Model(small_config(hidden=128).model).logits(params, jnp.zeros((1, 4), jnp.int32))


def test_flax_partition_specs_under_our_rules_are_the_trainers():
    cfg = small_config()
    cfg = cfg.updated(parallel=dict(data=2, fsdp=2, tensor=2))
    module = nnx.eval_shape(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)))
    with nnx.logical_axis_rules(AXIS_RULES):
        flax_specs = nnx.get_partition_spec(nnx.state(module, nnx.Param))
    flax_specs = nnx.to_pure_dict(flax_specs)
    trainer = build_run(cfg, make_mesh(cfg.parallel)).shardings["params"]
    want = {k: _padded(s.spec, len(s.spec)) for k, s in _flat(trainer).items()}
    got = {k: _padded(s, len(want[k])) for k, s in _flat(flax_specs).items()}
    assert got == want
    assert got["groups/layers/mlp/down"] == (None, None, "tensor", "fsdp")  # Megatron row-parallel, ZeRO-3


def _flat(tree) -> dict:
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in leaves}


def _padded(spec, n) -> tuple:
    """A spec as a tuple without trailing Nones (P('a', None) and P('a') shard alike)."""
    dims = list(spec)
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)


def test_checkpoint_written_before_the_modules_restores_and_continues(tmp_path):
    """A checkpoint that the pre-module trainer wrote (tests/support/fixtures/pre_flax_checkpoint) restores
    into the module-built state and trains on to the losses that trainer logged next."""
    workdir = shutil.copytree(FIXTURES / "pre_flax_checkpoint", tmp_path / "run")
    want = json.loads((workdir / "continuation.json").read_text())["losses"]
    cfg = saved_config(workdir)
    mesh = make_mesh(cfg.parallel, jax.devices()[:4])
    with jax.set_mesh(mesh):
        restored = build_run(cfg, mesh).checkpointer(workdir).restore_latest()
        assert restored.step == 3
        restored_params = jax.device_get(restored.state["params"])  # before the step donates them
        state, step, losses = restored.state, compile_train_step(build_run(cfg, mesh)), []
        for i in (3, 4):  # the batches the fixture's trainer took next
            w = np.random.default_rng(i).integers(
                0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1)
            )
            batch = {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}
            state, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)))
            losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want, rtol=1e-5)

    # The same checkpoint through an export into a module, as serving will load it.
    export(workdir, tmp_path / "export", tokenizer="gpt2")  # the fixture predates saved tokenizers
    exported_cfg, params, _ = load_params(tmp_path / "export")
    module = Model(exported_cfg.model).bind(params)
    chex.assert_trees_all_equal(params_of(module), restored_params)
    tokens = jnp.arange(16).reshape(2, 8)
    with jax.set_mesh(make_mesh(cfg.parallel, jax.devices()[:4])):
        functional = jax.jit(lambda p: Model(cfg.model).logits(p, tokens))(restored_params)
    np.testing.assert_allclose(module(tokens), functional, rtol=1e-5, atol=1e-5)


def test_docs_flax_snippet_runs_as_written(capsys):
    snippet = runnable_block("docs/model.md", "flax-snippet")
    exec(compile(snippet, "docs/model.md (Flax snippet)", "exec"), {})
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", capsys.readouterr().out)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
