"""LoRA: adapters that start as no change, fold into their weights exactly, train alone (base weights
bit-identical, optimizer state for adapters only) on every layout as on one device, and restore from
a checkpoint onto another layout."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.runs import small_config

from jaxllm import plan
from jaxllm.checkpoint import Checkpointer, load_params
from jaxllm.checkpoint.layout import to_canonical
from jaxllm.config import LoraConfig
from jaxllm.data.tokenizer import get_tokenizer, save_tokenizer, train_bpe
from jaxllm.model import Model
from jaxllm.model.dense import einsum_projections
from jaxllm.model.generate import generate
from jaxllm.model.int8 import quantize_tree
from jaxllm.model.lora import Adapted, adapted, adapter_mask, combine, dropped, merge_adapters, partition, with_adapters
from jaxllm.model.params import count
from jaxllm.parallel.mesh import make_mesh
from jaxllm.serve.generation import Request
from jaxllm.serve.load import load_engine
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_train_step, init_state

LORA = dict(rank=4, alpha=8.0, targets="q,v,o,gate,down")


def _cfg(layout=None, model=None, **lora):
    return small_config(vocab_size=300).updated(model=dict(lora=LORA | lora, **(model or {})), parallel=layout or {})


def _perturbed(params: dict, specs: dict) -> dict:
    """`params` with random adapters (a fresh b is zero, which would hide a wrong a·b)."""
    adapters, base = partition(params, adapter_mask(specs))
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
    noisy = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(next(keys), a.shape, a.dtype), adapters)
    return combine(base, noisy)


def test_fresh_adapters_change_nothing_and_fold_exactly():
    cfg = _cfg()
    model, plain = Model(cfg.model), Model(cfg.model.replace(lora=LoraConfig()))
    params = model.init(0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12)))
    adapters, base = partition(params, adapter_mask(model.specs))
    # The adapters sit beside their weights; the base params are exactly the plain model's.
    chex.assert_trees_all_equal(base, plain.init(0))
    assert set(adapters["groups"]["qkv"]) == {"q_lora", "v_lora"}
    assert set(adapters["groups"]["layers"]["mlp"]) == {"gate_lora", "down_lora"}
    np.testing.assert_array_equal(model.logits(params, tokens), plain.logits(base, tokens))

    trained = _perturbed(params, model.specs)
    adapted_logits = model.logits(trained, tokens)
    assert np.abs(adapted_logits - plain.logits(base, tokens)).max() > 1e-2  # the adapters do something
    merged, merged_model = merge_adapters(trained, cfg.model)
    assert merged_model.lora.rank == 0
    np.testing.assert_allclose(plain.logits(merged, tokens), adapted_logits, rtol=1e-5, atol=1e-5)


def _batch(cfg):
    w = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


def _train(layout: dict, steps: int = 3, workdir=None, model=None, **lora):
    cfg = _cfg(layout, model, **lora)
    devices = jax.devices() if layout else jax.devices()[:1]
    mesh = make_mesh(cfg.parallel, devices)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = init_state(run)
        init = jax.device_get(state["params"])
        step, batch = compile_train_step(run), jax.device_put(_batch(cfg), batch_sharding(mesh))
        losses = []
        for _ in range(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        if workdir is not None:
            saver = Checkpointer(workdir, cfg, mesh, run.canonical, run.shardings)
            saver.save(steps, state, {})
            saver.wait()
            saver.close()
        return dict(init=init, losses=losses, state=jax.device_get(state), run=run)


@pytest.fixture(scope="module")
def single():
    return _train({})


def test_only_adapters_train_and_base_weights_stay_bit_identical(single):
    specs = single["run"].model.specs
    adapters, base = partition(single["state"]["params"], adapter_mask(specs))
    init_adapters, init_base = partition(single["init"], adapter_mask(specs))
    chex.assert_trees_all_equal(base, init_base)
    assert single["losses"][-1] < single["losses"][0]  # the same batch each step: the adapters learn it
    pairs = zip(jax.tree.leaves(adapters), jax.tree.leaves(init_adapters), strict=True)
    assert all(np.abs(a - b).max() > 0 for a, b in pairs)
    # Adam's moments exist for the adapters alone.
    moments = single["state"]["opt_state"][1][0].mu
    assert jax.tree.structure(moments) == jax.tree.structure(adapters)


def test_lora_on_tensor_stage_fsdp_matches_one_device(single, tmp_path):
    layout = dict(data=1, fsdp=2, stage=2, tensor=2, microbatches=2)
    got = _train(layout, workdir=tmp_path)
    np.testing.assert_allclose(got["losses"], single["losses"], rtol=1e-5)
    mask = adapter_mask(single["run"].model.specs)
    ours = partition(to_canonical(got["state"]["params"], got["run"].schedule), mask)
    theirs = partition(single["state"]["params"], mask)
    # Adam divides by sqrt(v): fp32 reduction-order noise moves a near-zero gradient's update a
    # little. atol is 1 % of one update (lr 1e-2): a wrong gradient moves a weight by whole updates.
    chex.assert_trees_all_close(ours[0], theirs[0], rtol=1e-3, atol=1e-4)
    chex.assert_trees_all_equal(ours[1]["embed"], theirs[1]["embed"])

    # The checkpoint (saved from the 8-device pipeline) restores onto one device, adapters folded
    # into their weights, as the one-device run's params folded.
    cfg, params, step = load_params(tmp_path)
    assert step == 3 and cfg.model.lora.rank == 0
    want, plain = merge_adapters(single["state"]["params"], single["run"].cfg.model)
    chex.assert_trees_all_close(jax.device_get(params), want, rtol=1e-3, atol=1e-4)

    # The server serves the run with its adapters folded in: its greedy tokens are the merged model's.
    tokenizer = get_tokenizer(train_bpe(iter(["a LoRA run, served"] * 4), 300, tmp_path / "bpe"))
    save_tokenizer(tokenizer, tmp_path / "tokenizer")
    engine = load_engine(tmp_path, {"serve.dtype": "float32", "serve.max_len": 32, "serve.slots": 2})
    prompt = [5, 17, 42, 7]
    (served,) = engine.generate([Request(prompt, max_tokens=8, temperature=0, ignore_eos=True)])
    assert served.choices()[0].tokens == generate(want, Model(plain), prompt, 12, vocab_size=tokenizer.vocab_size)[4:]


def test_adapter_dropout_drops_its_rate_and_keeps_the_expectation():
    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32), jnp.asarray(rng.normal(size=(16, 12)), jnp.float32)
    a, b = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32), jnp.asarray(rng.normal(size=(3, 12)), jnp.float32)
    rate, spec = 0.25, "bte,ef->btf"
    kept = np.asarray(dropped(jnp.ones((200_000,)), jax.random.key(0), rate))
    assert abs((kept == 0).mean() - rate) < 4 * (rate * (1 - rate) / kept.size) ** 0.5  # binomial, 4 sigma
    np.testing.assert_allclose(kept[kept > 0], 1 / (1 - rate))
    op = with_adapters(einsum_projections, 2.0, rate)
    plain = op(x, (Adapted(w, a, b),), spec)[0]  # no key (evaluation, serving): no dropout
    np.testing.assert_allclose(plain, x @ w + (x @ a) @ b * 2.0, rtol=1e-5, atol=1e-5)
    draws = jax.vmap(lambda k: op(x, (Adapted(w, a, b, k),), spec)[0])(jax.random.split(jax.random.key(1), 4000))
    assert np.abs(draws[0] - plain).max() > 0.1 and np.abs(draws[0] - draws[1]).max() > 0.1
    # Inverted dropout is unbiased: the mean of the draws is the undropped projection (to 5 standard errors).
    error = np.asarray(draws.std(0) / np.sqrt(draws.shape[0]))
    assert (np.abs(np.asarray(draws.mean(0) - plain)) < 5 * error + 1e-6).all()


def test_each_adapter_of_a_layer_draws_its_own_dropout_mask():
    """As PEFT's one dropout module per adapted projection: a layer's key gives the q and k adapters,
    on the same input with the same weights, different masks, each the same every time."""
    rng = np.random.default_rng(0)
    x, w, a, b = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 8, 16), (16, 12), (16, 3), (3, 12)))
    lora = {"a": a, "b": b}
    params = {"q": w, "q_lora": lora, "k": w, "k_lora": lora}
    op, layer = with_adapters(einsum_projections, 2.0, 0.5), jax.random.key(3)
    q, k, q_again = (op(x, (adapted(params, name, layer),), "bte,ef->btf")[0] for name in ("q", "k", "q"))
    np.testing.assert_array_equal(q, q_again)
    assert np.abs(np.asarray(q - k)).max() > 0.1


@pytest.mark.parametrize(
    "layout",
    [
        dict(data=1, fsdp=2, stage=2, tensor=2, microbatches=2, schedule="1f1b"),
        dict(data=1, fsdp=2, stage=2, tensor=2, microbatches=2, repeats=2, schedule="interleaved_1f1b"),
        dict(data=1, fsdp=2, stage=2, tensor=2, microbatches=2, schedule="zero_bubble"),
        dict(data=1, fsdp=2, stage=2, tensor=2, microbatches=2, repeats=2, schedule="interleaved_zero_bubble"),
    ],
    ids=["1f1b", "interleaved 1f1b", "zero bubble", "interleaved zero bubble"],
)
def test_lora_under_timetable_driven_pipelines_matches_one_device(layout):
    """Three steps of adapters (8 layers, so that two chunks a stage fall on group boundaries): the
    losses and the adapters as on one device, the base weights untouched."""
    one, got = _train({}, model=dict(num_layers=8)), _train(layout, model=dict(num_layers=8))
    np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-5)
    mask = adapter_mask(one["run"].model.specs)
    ours = partition(to_canonical(got["state"]["params"], got["run"].schedule), mask)
    theirs = partition(one["state"]["params"], mask)
    chex.assert_trees_all_close(ours[0], theirs[0], rtol=1e-3, atol=1e-4)  # as in the test above
    chex.assert_trees_all_equal(ours[1], partition(to_canonical(got["init"], got["run"].schedule), mask)[1])


def test_adapter_dropout_trains_on_every_layout_and_repeats_with_its_seed(single):
    pipelines = [dict(data=2, stage=2, tensor=2, microbatches=2, schedule=s) for s in ("gpipe", "1f1b", "zero_bubble")]
    runs = [_train(layout, dropout=0.3) for layout in ({}, {}, *pipelines)]
    one, again, *spread = (r["losses"] for r in runs)
    assert one == again  # the masks are a function of the seed and the step
    assert one[0] == single["losses"][0] and one[1:] != single["losses"][1:]  # b starts at 0: step 0 drops nothing
    assert one[-1] < one[0] and all(losses[-1] < losses[0] for losses in spread)


INT8 = dict(quantize="int8")


def test_an_int8_base_stays_frozen_under_its_adapters_on_every_layout(single, tmp_path):
    one = _train({}, model=INT8)
    got = _train(dict(data=1, fsdp=2, stage=2, tensor=2, microbatches=2), workdir=tmp_path, model=INT8)
    full, int8 = (Model(_cfg(model=m).model) for m in ({}, INT8))
    # The base is the full-precision run's initial weights quantized, and stays bit-identical.
    adapters, base = partition(one["state"]["params"], adapter_mask(int8.specs))
    fp_base = partition(single["init"], adapter_mask(full.specs))[1]
    specs = [partition(m.specs, adapter_mask(m.specs))[1] for m in (full, int8)]
    chex.assert_trees_all_equal(base, quantize_tree(fp_base, *specs))
    chex.assert_trees_all_equal(base, partition(one["init"], adapter_mask(int8.specs))[1])
    assert jax.tree.leaves(base["groups"]["qkv"]["q"])[0].dtype == jnp.int8
    # It stands for the fp32 weights to within int8's rounding, and the adapters learn through it.
    assert abs(one["losses"][0] - single["losses"][0]) < 1e-2 * single["losses"][0]
    assert one["losses"][0] != single["losses"][0] and one["losses"][-1] < one["losses"][0]
    assert jax.tree.structure(one["state"]["opt_state"][1][0].mu) == jax.tree.structure(adapters)
    # The 8-device pipeline (int8 copies, fp32 scales) computes what one device does.
    np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-5)
    chex.assert_trees_all_equal(partition(to_canonical(got["state"]["params"], got["run"].schedule),
                                          adapter_mask(int8.specs))[1], base)  # fmt: skip
    # The planner counts the int8 base's bytes as the train state holds them.
    held = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(one["run"].state["params"]))
    assert plan.memory(one["run"].cfg)["params"] == held < plan.memory(single["run"].cfg)["params"] / 2

    # The checkpoint loads with the adapters folded in and the sum quantized again: int8 weights
    # whose logits are the trained (unmerged) model's to within that rounding.
    cfg, params, _ = load_params(tmp_path)
    assert cfg.model.quantize == "int8" and cfg.model.lora.rank == 0
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 300, (2, 12)))
    want = int8.logits(one["state"]["params"], tokens)[..., :300]
    served = Model(cfg.model).logits(params, tokens)[..., :300]
    assert np.abs(served - want).max() < 2e-2 * np.abs(want).max()


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_planner_counts_the_adapters_and_their_optimizer_state_alone(activation):
    cfg = _cfg(targets="q,k,v,o,gate,up,down").updated(model=dict(mlp_activation=activation))
    specs = Model(cfg.model).specs
    adapters = partition(specs, adapter_mask(specs))[0]
    assert plan.param_counts(cfg.model)["total"] == count(specs)
    assert plan.param_counts(cfg.model)["LoRA adapters"] == count(adapters)
    planned, full = plan.memory(cfg), plan.memory(cfg.updated(model=dict(lora=dict(rank=0))))
    assert planned["optimizer state (Adam m, v)"] == 2 * 4 * count(adapters)  # fp32 m and v, one device
    assert planned["params"] == full["params"] + 4 * count(adapters)
    assert full["optimizer state (Adam m, v)"] == 2 * 4 * count(Model(cfg.model.replace(lora=LoraConfig())).specs)


def test_a_fine_tuning_plan_sets_the_other_methods_beside_it():
    from jaxllm.plan.hardware import ACCELERATORS
    from jaxllm.plan.report import memory_report

    full = _cfg(rank=0).updated(data=dict(format="chat"))
    lora = dict(rank=16, alpha=32.0, targets="q,k,v,o,gate,up,down")
    bf16 = full.updated(model=dict(lora=lora, param_dtype="bfloat16"))
    int8 = bf16.updated(model=dict(quantize="int8"))
    device = ACCELERATORS["a100-80gb"]

    def gib(cfg) -> str:
        return f"{plan.memory(cfg)['total'] / 2**30:.2f} GiB"

    lines = {
        "full": f"  full fine-tuning instead, fp32 weights: {gib(full)}",
        "bf16": f"  LoRA instead, rank 16, base frozen in bf16: {gib(bf16)}",
        "int8": f"  LoRA instead, rank 16, base frozen in int8: {gib(int8)}",
    }
    for own, cfg in {"full": full, "bf16": bf16, "int8": int8}.items():
        assert memory_report(cfg, device, 0.1)[-2:] == [line for method, line in lines.items() if method != own]
    assert plan.memory(int8)["total"] < plan.memory(bf16)["total"] < plan.memory(full)["total"]
