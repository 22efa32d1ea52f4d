"""The pipeline against a plain sequential loop over the same weights, its collectives, and its
training losses against the same run without it."""

import re
from collections import Counter

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.compare import assert_leaves_within, first_moment, proportional_updates, updates
from support.reference_model import reference_loss
from support.runs import small_config

from jaxllm import plan
from jaxllm.model import Model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import activation_rules, rules_for
from jaxllm.parallel.schedule import canonical_view
from jaxllm.plan import hlo
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_eval_step, compile_train_step, init_state, mean_loss

# (stages, microbatches, repeats, other mesh axes, model options): covers M ∈ {S, 2S}, R ∈ {1, 2},
# S ∈ {2, 4}, the combined layouts, and every model option through the pipeline.
CASES = {
    "S2 M2 R1 data4": (2, 2, 1, dict(data=4), {}),
    "S2 M4 R2 data4": (2, 4, 2, dict(data=4), {}),
    "S4 M4 R1 data2": (4, 4, 1, dict(data=2), {}),
    "S4 M8 R2 data2": (4, 8, 2, dict(data=2), {}),
    "S2 M4 R1 tensor2 data2": (2, 4, 1, dict(tensor=2, data=2), {}),
    "S2 M2 R2 fsdp2 tensor2": (2, 2, 2, dict(fsdp=2, tensor=2, data=1), {}),
    "S4 M4 R2 data2 remat full": (4, 4, 2, dict(data=2), dict(remat="full")),
    "S2 M2 R2 fsdp2 data2 layernorm geglu tied mha": (
        2, 2, 2, dict(fsdp=2, data=2),
        dict(norm="layernorm", mlp_activation="geglu", tie_embeddings=True, num_kv_heads=8),
    ),
    "S2 M2 R1 tensor2 data2 gelu share 4": (
        2, 2, 1, dict(tensor=2, data=2), dict(mlp_activation="gelu", qkv_share_every=4),
    ),
    "S2 M2 R1 data4 share 1": (2, 2, 1, dict(data=4), dict(num_layers=8, qkv_share_every=1)),
    "S2 M4 R2 tensor2 data2 sequence parallel": (2, 4, 2, dict(tensor=2, data=2, sequence_parallel=True), {}),
    # Schedules run by a timetable: S ∈ {2, 4}, M ∈ {S, 2S, 4S}, with tensor 2 and with FSDP 2.
    "1f1b S2 M2 data4": (2, 2, 1, dict(data=4, schedule="1f1b"), {}),
    "1f1b S2 M8 tensor2 data2": (2, 8, 1, dict(tensor=2, data=2, schedule="1f1b"), {}),
    "1f1b S4 M4 data2": (4, 4, 1, dict(data=2, schedule="1f1b"), {}),
    "1f1b S4 M8 fsdp2": (4, 8, 1, dict(fsdp=2, data=1, schedule="1f1b"), {}),
    "1f1b S4 M16 tensor2": (4, 16, 1, dict(tensor=2, data=1, schedule="1f1b"), {}),
    "1f1b S2 M4 fsdp2 data2 layernorm geglu tied mha remat full": (
        2, 4, 1, dict(fsdp=2, data=2, schedule="1f1b"),
        dict(norm="layernorm", mlp_activation="geglu", tie_embeddings=True, num_kv_heads=8, remat="full"),
    ),
    "interleaved S4 M4 R2 data2": (4, 4, 2, dict(data=2, schedule="interleaved_1f1b"), {}),
    "interleaved S2 M4 R2 fsdp2 tensor2": (2, 4, 2, dict(fsdp=2, tensor=2, data=1, schedule="interleaved_1f1b"), {}),
    "interleaved S2 M8 R2 tensor2 data2 sequence parallel": (
        2, 8, 2, dict(tensor=2, data=2, sequence_parallel=True, schedule="interleaved_1f1b"), {},
    ),
    "zero bubble S2 M4 data4": (2, 4, 1, dict(data=4, schedule="zero_bubble"), {}),
    "zero bubble S2 M2 tensor2 data2": (2, 2, 1, dict(tensor=2, data=2, schedule="zero_bubble"), {}),
    "zero bubble S4 M8 fsdp2": (4, 8, 1, dict(fsdp=2, data=1, schedule="zero_bubble"), {}),
    "zero bubble S4 M16 tensor2 remat full": (
        4, 16, 1, dict(tensor=2, data=1, schedule="zero_bubble"), dict(remat="full"),
    ),
    "zero bubble S4 M4 data2 sequence parallel": (
        4, 4, 1, dict(tensor=2, data=1, sequence_parallel=True, schedule="zero_bubble"), {},
    ),
    "interleaved zero bubble S4 M8 R2 data2": (4, 8, 2, dict(data=2, schedule="interleaved_zero_bubble"), {}),
    "interleaved zero bubble S2 M4 R2 fsdp2 tensor2": (
        2, 4, 2, dict(fsdp=2, tensor=2, data=1, schedule="interleaved_zero_bubble"), {},
    ),
    "interleaved zero bubble S2 M8 R2 tensor2 data2 sequence parallel remat full": (
        2, 8, 2, dict(tensor=2, data=2, sequence_parallel=True, schedule="interleaved_zero_bubble"), dict(remat="full"),
    ),
}  # fmt: skip


def _config(stages, microbatches, repeats, axes, **model):
    cfg = small_config(**{"num_layers": 16, "qkv_share_every": 2, **model})  # 8 groups by default
    axes = {"schedule": "circular" if repeats > 1 else "gpipe", **axes}
    return cfg.updated(parallel=dict(stage=stages, microbatches=microbatches, repeats=repeats, **axes))


def _batch(cfg):
    w = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_pipeline_matches_sequential_loop(case):
    cfg = _config(*case[:4], **case[4])
    mesh = make_mesh(cfg.parallel)
    batch = _batch(cfg)
    with jax.set_mesh(mesh), activation_rules(rules_for(cfg.parallel)):  # as the train step does
        state = init_state(build_run(cfg, mesh))
        loss_fn = jax.jit(jax.value_and_grad(lambda p, b: mean_loss(p, b, Model(cfg.model, cfg.parallel.pipeline))))
        loss, grads = loss_fn(state["params"], jax.device_put(batch, batch_sharding(mesh)))
    params, grads = jax.device_get((state["params"], grads))
    params["groups"], grads["groups"] = canonical_view(params["groups"]), canonical_view(grads["groups"])
    want_loss, want_grads = jax.value_and_grad(reference_loss)(params, batch, cfg.model)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-7)


def _compiled(cfg, compile_fn, part=lambda state: state):
    """Compiled HLO text and memory analysis of `compile_fn(run)` on (`part` of) an abstract
    state and a batch."""
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run_ = build_run(cfg, mesh)
        state = part(jax.eval_shape(lambda: init_state(run_)))
        batch = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=run_.batch_sharding) for k, v in _batch(cfg).items()
        }
        compiled = compile_fn(run_).lower(state, batch).compile()
    return compiled.as_text(), compiled.memory_analysis()


def _stage_weight_shapes(cfg, *, scattered: bool = False) -> Counter:
    """Per-device shape of each stage weight as the loop reads it (one stage, whole on `fsdp`), or
    with `scattered` its gradient's shard after the reduce-scatter. Shapes are compared as sorted
    dims other than 1: XLA may move or drop the stage dim, and on CPU it runs bf16 collectives in fp32."""
    specs = Model(cfg.model, cfg.parallel.pipeline).specs["groups"]
    split = {"stages": cfg.parallel.stage, "embed": cfg.parallel.fsdp if scattered else 1}
    return Counter(
        _dims(d // split.get(axis, 1) for d, axis in zip(spec.shape, spec.axes, strict=True))
        for spec in jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "axes"))
    )


def _dims(shape) -> tuple[int, ...]:
    return tuple(sorted(d for d in shape if d != 1))


def _result_shapes(line: str) -> list[tuple[int, ...]]:
    """Sorted dims of every array an HLO instruction returns."""
    result = re.match(r"\s*%\S+ = (.*?) [\w-]+\(", line).group(1)
    return [_dims(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", result)]


def _executed_shapes(text: str, op: str) -> Counter:
    """Result shapes of every `op` instruction, counted as often as it runs."""
    runs, shapes = hlo.executions(text), Counter()
    for comp, line in hlo.ops(text, op):
        for shape in _result_shapes(line):
            shapes[shape] += runs[comp]
    return shapes


def test_stage_weights_gathered_once_per_step_and_gradients_reduced_after_the_loop():
    """R=2 with 2 accumulation microsteps: each stage weight is all-gathered over fsdp once per
    step (trip counts of the loops around each gather multiplied out), and its gradient is reduced
    once per accumulation microstep, after the pipeline loop, never inside it."""
    accum = 2
    cfg = _config(2, 4, 2, dict(fsdp=2, tensor=1, data=2), dtype="bfloat16")
    cfg = cfg.updated(train=dict(grad_accum_steps=accum, batch_size=32))
    text, _ = _compiled(cfg, compile_train_step)
    weights, grads = _stage_weight_shapes(cfg), _stage_weight_shapes(cfg, scattered=True)
    embedding = _dims((cfg.model.hidden, cfg.model.padded_vocab // cfg.parallel.tensor))
    assert embedding not in weights, "the embedding's gather must not pass for a stage weight's"
    gathered = _executed_shapes(text, "all-gather")
    assert {k: gathered[k] for k in weights} == weights, "each stage weight gathered exactly once per step"
    scattered = _executed_shapes(text, "reduce-scatter")
    assert {k: scattered[k] for k in grads} == {k: accum * n for k, n in grads.items()}
    runs = hlo.executions(text)
    for comp, line in hlo.ops(text, "all-reduce") + hlo.ops(text, "reduce-scatter"):
        if set(_result_shapes(line)) & (weights + grads).keys():
            assert runs[comp] <= accum, f"a weight gradient reduced inside the pipeline loop: {line[:200]}"
    loops = hlo.loop_bodies(text)
    assert any(comp in loops for comp, _ in hlo.ops(text, "collective-permute")), "stage shifts inside the loop"


def test_head_and_loss_run_once_on_a_slice_of_the_sequence_per_stage():
    """The pipeline's output reaches the head split over `stage` along the sequence: each stage
    computes logits for 1/S of the tokens, and no device holds logits for the whole sequence."""
    cfg = _config(2, 2, 1, dict(tensor=2, data=2))
    cfg = cfg.updated(train=dict(seq_len=32))
    text, _ = _compiled(cfg, compile_eval_step, lambda state: state["params"])
    rows, vocab = cfg.train.batch_size // cfg.parallel.data, cfg.model.padded_vocab // cfg.parallel.tensor
    assert f"f32[{rows},{cfg.train.seq_len // 2},{vocab}]" in text, "logits for half the sequence per stage"
    assert f"f32[{rows},{cfg.train.seq_len},{vocab}]" not in text, "logits for the whole sequence on a stage"


def test_table_schedules_split_the_heads_vocabulary_over_stage_and_tensor_inside_the_loop():
    """1F1B on 2 stages with tensor 2 and sequence parallelism: the loop computes each microbatch's
    logits over the whole sequence for a quarter of the vocabulary on every device, with a quarter
    of the head matrix and of its fp32 gradient (the stored parameter stays split over `tensor`)."""
    cfg = _config(2, 2, 1, dict(tensor=2, data=2, schedule="1f1b", sequence_parallel=True))
    text, _ = _compiled(cfg, compile_train_step)
    rows = cfg.train.batch_size // cfg.parallel.data // cfg.parallel.microbatches
    seq, vocab, hidden = cfg.train.seq_len, cfg.model.padded_vocab, cfg.model.hidden
    assert f"f32[{rows},{seq},{vocab // 4}]" in text, "a microbatch's logits for a quarter of the vocabulary"
    for width in (vocab, vocab // 2):
        assert f"[{rows},{seq},{width}]" not in text and f"[{rows},{seq // 2},{width}]" not in text
    assert f"f32[{hidden},{vocab // 4}]" in text, "a quarter of the head and its gradient in the loop"
    assert f"f32[{hidden},{vocab}]" not in text, "the whole head matrix on a device"


def test_schedules_compiled_temporaries():
    """S=4, M=16, compiled temporaries per device. The circular schedule's delay line holds M − S = 12
    microbatches; if the backward pass kept it for each of its 35 iterations, R=2 would need 3.5×
    GPipe's (measured by making the line a residual on purpose): circular ≤ 1.2 × GPipe. 1F1B holds
    2S − 1 stage inputs where GPipe keeps M + S − 1: 1F1B ≤ 0.9 × GPipe, and interleaving two chunks
    per stage ≤ 1.2 × 1F1B. Zero-bubble keeps its units' residuals and its put-off weight passes'
    taps on top of 1F1B's (interleaved, on top of interleaved 1F1B's): what that adds is the
    planner's, within 25 %."""
    temporaries, planned = {}, {}
    for schedule, repeats in (
        ("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
        ("interleaved_zero_bubble", 2),
    ):  # fmt: skip
        cfg = small_config(num_layers=8, qkv_share_every=1, hidden=256, mlp=256, num_heads=4, num_kv_heads=4)
        layout = dict(stage=4, microbatches=16, repeats=repeats, data=2, schedule=schedule)
        cfg = cfg.updated(parallel=layout, train=dict(batch_size=128, seq_len=64))
        _, memory = _compiled(cfg, compile_train_step)
        temporaries[schedule], planned[schedule] = memory.temp_size_in_bytes, plan.memory(cfg)["total"]
    print({k: round(v / 2**20, 1) for k, v in temporaries.items()})
    assert temporaries["circular"] <= 1.2 * temporaries["gpipe"], temporaries
    assert temporaries["1f1b"] <= 0.9 * temporaries["gpipe"], temporaries
    assert temporaries["interleaved_1f1b"] <= 1.2 * temporaries["1f1b"], temporaries
    assert temporaries["interleaved_1f1b"] < temporaries["interleaved_zero_bubble"] < temporaries["zero_bubble"]
    for split, whole in (("zero_bubble", "1f1b"), ("interleaved_zero_bubble", "interleaved_1f1b")):
        added = temporaries[split] - temporaries[whole]
        assert 0.75 < (planned[split] - planned[whole]) / added < 1.25, (temporaries, planned)


def test_1f1b_holds_half_of_gpipes_temporaries_where_activations_outweigh_weights():
    """S=4, M=16 with microbatches of 32 sequences a device and remat full, where the activations
    outweigh the weights, their gradients and the optimizer's work: GPipe keeps M + S − 1
    iteration inputs, 1F1B 2S − 1 stage inputs (its first stage embeds each microbatch as it
    comes, and each unit builds its RoPE tables), so 1F1B needs at most half of GPipe's."""
    temporaries = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = small_config(num_layers=8, qkv_share_every=1, hidden=256, mlp=256, num_heads=4, num_kv_heads=4,
                           remat="full")  # fmt: skip
        layout = dict(stage=4, microbatches=16, data=2, schedule=schedule)
        cfg = cfg.updated(parallel=layout, train=dict(batch_size=1024, seq_len=64))
        temporaries[schedule] = _compiled(cfg, compile_train_step)[1].temp_size_in_bytes
    print({k: round(v / 2**20, 1) for k, v in temporaries.items()})
    assert temporaries["1f1b"] <= 0.5 * temporaries["gpipe"], temporaries


def _scan_carries(jaxpr):
    """Avals of every loop carry of every scan in a jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            start = eqn.params["num_consts"]
            yield from eqn.params["jaxpr"].in_avals[start : start + eqn.params["num_carry"]]
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield from _scan_carries(getattr(sub, "jaxpr", sub))


def _bf16_grads(layout, num_layers=8, batch_size=64):
    cfg = small_config(num_layers=num_layers, qkv_share_every=2, dtype="bfloat16")
    cfg = cfg.updated(train=dict(batch_size=batch_size, seq_len=16), parallel=layout)
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run_ = build_run(cfg, mesh)
        params = init_state(run_)["params"]
        batch = jax.device_put(_batch(cfg), run_.batch_sharding)
        grad_fn = jax.grad(lambda p, b: mean_loss(p, b, Model(cfg.model, run_.schedule)))
        grads, jaxpr = jax.jit(grad_fn)(params, batch), jax.make_jaxpr(grad_fn)(params, batch)
    grads = jax.device_get(grads)
    if run_.schedule is not None:
        grads["groups"] = canonical_view(grads["groups"])
    return grads, jaxpr, cfg


def test_bf16_pipeline_gradients_match_unpipelined_and_add_up_in_fp32():
    """bf16 compute, S=2, M=8: every gradient leaf within 1e-2 (relative, in norm) of the run
    without a pipeline; and the loop sums each stage weight's gradient in an fp32 carry, with no
    bf16 carry of a weight's shape."""
    want, _, _ = _bf16_grads(dict(data=4, fsdp=2))
    got, jaxpr, cfg = _bf16_grads(dict(stage=2, microbatches=8, data=2, fsdp=2))
    errors = jax.tree.map(lambda g, w: float(np.linalg.norm(g - w) / np.linalg.norm(w)), got, want)
    assert max(jax.tree.leaves(errors)) <= 1e-2, errors
    carries = list(_scan_carries(jaxpr.jaxpr))
    specs = Model(cfg.model, cfg.parallel.pipeline).specs["groups"]
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "axes")):
        r, _, *rest = spec.shape  # the loop's per-stage weight: [repeats, groups per stage, ...]
        shape = (r, *rest)
        assert any(c.shape == shape and c.dtype == np.float32 for c in carries), f"no fp32 sum of {spec.axes}"
        assert not any(c.shape == shape and c.dtype == jnp.bfloat16 for c in carries), f"bf16 sum of {spec.axes}"


def test_bf16_pipeline_of_32_microbatches_rounds_no_weight_gradient_to_bf16():
    """bf16 compute, S=2, M=32 against one batch of the same rows without a pipeline. The two
    forward passes already differ in bf16's last bits, so every leaf differs by ~1e-3, the norm
    scales and the embedding (whose gradients are never a bf16 dot's result) included; that is
    the floor. A projection's weight gradient that is rounded to bf16 per microbatch before the
    fp32 sum adds 32 roundings of 2⁻⁹ relative and lands at ~2× the floor (measured: 4.0e-3 against
    2.0e-3); summed from each dot's fp32 result it stays at the floor. Bound: every projection leaf
    within 1.5× the largest other leaf."""
    want, _, _ = _bf16_grads(dict(data=4, fsdp=2), num_layers=4, batch_size=128)
    got, _, cfg = _bf16_grads(dict(stage=2, microbatches=32, data=4), num_layers=4, batch_size=128)
    specs = Model(cfg.model).specs
    errors = jax.tree.map(lambda g, w: float(np.linalg.norm(g - w) / np.linalg.norm(w)), got, want)
    projection = jax.tree.map(lambda s: s.quantizable, specs, is_leaf=lambda x: hasattr(x, "axes"))
    pairs = list(zip(jax.tree.leaves(errors), jax.tree.leaves(projection), strict=True))
    floor = max(e for e, p in pairs if not p)
    assert max(e for e, p in pairs if p) <= 1.5 * floor, errors


BF16_LAYOUTS = {
    "data2 tensor4": dict(data=2, tensor=4),
    "data4 tensor2 sequence parallel": dict(data=4, tensor=2, sequence_parallel=True),
    "S2 M2 tensor2 data2 sequence parallel": dict(stage=2, microbatches=2, tensor=2, data=2, sequence_parallel=True),
}


def _two_steps(cfg):
    """(initial params, Adam's first moment after one step: that step's gradient scaled, params
    after two steps), the pipeline's in the canonical view."""
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run_ = build_run(cfg, mesh)
        state, step = init_state(run_), compile_train_step(run_)
        initial = jax.device_get(state["params"])
        batch = jax.device_put(_batch(cfg), batch_sharding(mesh))
        state, _ = step(state, batch)
        gradient = jax.device_get(first_moment(state["opt_state"]))
        state, metrics = step(state, batch)
        assert float(metrics["lr"]) > 0
        out = initial, gradient, jax.device_get(state["params"])
    if run_.schedule is not None:
        for tree in out:
            tree["groups"] = canonical_view(tree["groups"])
    return out


@pytest.mark.parametrize("layout", BF16_LAYOUTS.values(), ids=BF16_LAYOUTS.keys())
def test_bf16_training_under_tensor_and_sequence_parallelism_tracks_fp32(layout):
    """bf16 compute through the tensor-parallel, sequence-parallel and pipeline collectives against
    the same run in fp32, leaf by leaf: the first step's gradients, and the params after two
    updates proportional to the gradients (see `proportional_updates`)."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = proportional_updates(small_config(dtype=dtype))  # 4 layers
        runs[dtype] = _two_steps(cfg.updated(parallel=layout))
    (init, grads, params), (bf16_init, bf16_grads, bf16_params) = runs["float32"], runs["bfloat16"]
    chex.assert_trees_all_equal(bf16_init, init)  # fp32 master weights either way
    # bf16 rounds to u = 2^-8; each of the L layers, crossed forward and back, adds ≲ u of relative error: ≤ 2·L·u
    bound = 2 * cfg.model.num_layers * 2.0**-8
    errors = assert_leaves_within(bf16_grads, grads, bound, "the first step's gradients")
    assert max(errors.values()) > 2.0**-8 / 8, "the bf16 run rounded nothing: it ran in fp32"
    assert_leaves_within(updates(bf16_params, init), updates(params, init), bound, "params after two steps")


@pytest.mark.parametrize(
    "layout, accum",
    [
        (dict(stage=2, microbatches=4, fsdp=2, data=2, schedule="1f1b"), 1),
        (dict(stage=2, microbatches=4, repeats=2, tensor=2, data=2, schedule="interleaved_1f1b"), 1),
        (dict(stage=2, microbatches=2, data=4, schedule="1f1b"), 2),
        (dict(stage=2, microbatches=2, repeats=2, fsdp=2, data=2, schedule="interleaved_zero_bubble"), 2),
    ],
    ids=["1f1b fsdp2", "interleaved tensor2", "1f1b accumulating 2", "interleaved zero-bubble fsdp2 accumulating 2"],
)
def test_table_schedules_train_two_steps_like_one_device(layout, accum):
    """fp32: Adam's first moment after one step (the step's gradient, scaled) and what two steps
    changed in the params (updates proportional to the gradients), with a timetable-driven pipeline
    (one of them inside gradient accumulation), equal the run's without a pipeline (each leaf to
    1e-5 and 1e-4 relative, in norm)."""
    cfg = proportional_updates(small_config(num_layers=8, qkv_share_every=2))  # Adam's m/√v would amplify noise
    plain = _two_steps(cfg.updated(parallel=dict(data=8)))
    piped = _two_steps(cfg.updated(parallel=layout, train=dict(grad_accum_steps=accum)))
    chex.assert_trees_all_equal(piped[0], plain[0])
    assert_leaves_within(piped[1], plain[1], 1e-5, "the first step's gradients")
    assert_leaves_within(updates(piped[2], piped[0]), updates(plain[2], plain[0]), 1e-4, "params after two steps")
