"""FP8 projections: the op against fp8 arithmetic done independently in numpy (ml_dtypes), its
error against full precision within the fp8 rounding bound, the amax reduction on every mesh
layout, remat residuals, and training through every layout against the same runs without FP8.

Error bound per dot, elementwise: with ε(a) = max(u·|a|, s·2^-m) the rounding of an operand a
(u = 2^-4 and m = 10 for e4m3, u = 2^-3 and m = 17 for e5m2: half a unit in the last place, or
half the subnormal spacing, times a's power-of-two scale s),
    |fp8 dot − exact dot| ≤ ε(a)·|b| + |a|·ε(b) + ε(a)·ε(b) + K·2^-24·|a|·|b| + ½ulp(result),
the K·2^-24 term for fp32 accumulation over K products and the last for rounding the result to
the compute dtype.
"""

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from jax.sharding import PartitionSpec as P
from support.compare import assert_leaves_within, first_moment, proportional_updates, updates
from support.runs import small_config

from jaxllm.config import REMAT_POLICIES
from jaxllm.model import Decoder, Model, layers, params_of
from jaxllm.model.decoder import _remat_wrappers
from jaxllm.model.dense import einsum_projections
from jaxllm.model.fp8 import E4M3, E5M2, fp8_projections, quantize
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.pipeline import Copy
from jaxllm.parallel.schedule import canonical_view
from jaxllm.plan import summary
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_train_step, init_state

ROUNDING = {E4M3: (2.0**-4, 10), E5M2: (2.0**-3, 17)}  # (u, m) of the module doc
SPEC = "bte,ehd->bthd"


def _inputs(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 4)
    x = (jax.random.normal(k[0], (4, 8, 64)) * 3).astype(dtype)
    x = x.at[0, 0].multiply(1e-4)  # a row of tiny values: some land in e4m3's subnormal range
    weights = (jax.random.normal(k[1], (64, 4, 16)) * 0.05, jax.random.normal(k[2], (64, 4, 16)) * 0.02)
    grads = tuple((jax.random.normal(key, (4, 8, 4, 16)) * 1e-3).astype(dtype) for key in jax.random.split(k[3], 2))
    return x, weights, grads


def _fp8_op(x, weights, grads):
    """(outputs, dx, dws) of the FP8 op for output cotangents `grads`."""
    outs, vjp = jax.vjp(lambda x, ws: fp8_projections("global")(x, ws, SPEC), x, weights)
    dx, dws = vjp(grads)
    return outs, dx, dws


def _scaled(a: np.ndarray, fmt):
    """(a / s rounded to `fmt`, s) in float64, s the smallest power of two keeping amax / s in range."""
    fmax = float(ml_dtypes.finfo(fmt).max)
    s = 2.0 ** math.frexp(float(np.abs(a).max()) / fmax)[1]
    return (a / s).astype(np.float32).astype(fmt).astype(np.float64), s


def _einsums(spec):
    (x, w), y = spec.split("->")[0].split(","), spec.split("->")[1]
    return spec, f"{y},{w}->{x}", f"{x},{y}->{w}"  # forward, dx, dw


def test_op_is_fp8_arithmetic_done_independently():
    """Forward on e4m3 operands, dx and dw on e5m2 output gradients, each scaled by a power of two
    from its own amax: the op equals the same arithmetic in float64 up to fp32 accumulation."""
    x, weights, grads = _inputs()
    outs, dx, dws = _fp8_op(x, weights, grads)
    fwd, bwd_x, bwd_w = _einsums(SPEC)
    qx, sx = _scaled(np.asarray(x, np.float64), ml_dtypes.float8_e4m3fn)
    want_dx = 0
    for w, g, out, dw in zip(weights, grads, outs, dws, strict=True):
        qw, sw = _scaled(np.asarray(w, np.float64), ml_dtypes.float8_e4m3fn)
        qg, sg = _scaled(np.asarray(g, np.float64), ml_dtypes.float8_e5m2)
        _close_to_fp32(out, np.einsum(fwd, qx, qw) * sx * sw)
        _close_to_fp32(dw, np.einsum(bwd_w, qx, qg) * sx * sg)
        want_dx = want_dx + np.einsum(bwd_x, qg, qw) * sg * sw
    _close_to_fp32(dx, want_dx)


@pytest.mark.parametrize("fp8", [False, True], ids=["einsum", "fp8"])
@pytest.mark.parametrize("pipeline", [False, True], ids=["fp32 weight", "pipeline copy"])
def test_weight_gradient_is_the_fp32_result_of_its_dot(fp8, pipeline):
    """bf16 compute: each weight's gradient is its dot's fp32 result, unrounded (on an fp32
    parameter, or on the fp32 sink of a pipeline's bf16 copy), so sums over microbatches add fp32
    terms: the backward holds a dot with an fp32 result of the weight's shape for each weight, and
    dw equals the same dot of the bf16 operands in float64 to fp32 accuracy (a bf16 result is
    2⁻⁹ off)."""
    x, weights, grads = _inputs(jnp.bfloat16)
    project = fp8_projections("global") if fp8 else einsum_projections

    def dws(x, weights):
        if pipeline:
            weights = tuple(Copy(w.astype(jnp.bfloat16), jnp.zeros_like(w)) for w in weights)
        return jax.vjp(lambda ws: project(x, ws, SPEC), weights)[1](grads)[0]

    got = dws(x, weights)
    got = tuple(w.sink if pipeline else w for w in got)
    assert all(dw.dtype == jnp.float32 for dw in got)
    jaxpr = jax.make_jaxpr(dws)(x, weights).jaxpr
    dots = [e.outvars[0].aval for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert sum(a.dtype == jnp.float32 and sorted(a.shape) == sorted(weights[0].shape) for a in dots) == 2, dots
    _, _, bwd_w = _einsums(SPEC)
    for g, dw in zip(grads, got, strict=True):
        xs, gs = np.asarray(x, np.float64), np.asarray(g, np.float64)
        if fp8:
            (xs, sx), (gs, sg) = _scaled(xs, ml_dtypes.float8_e4m3fn), _scaled(gs, ml_dtypes.float8_e5m2)
            xs, gs = xs * sx, gs * sg
        _close_to_fp32(dw, np.einsum(bwd_w, xs, gs))


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (custom VJPs, pjit) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield from _eqns(getattr(sub, "jaxpr", sub))


def _close_to_fp32(got, want):
    """Equal up to fp32 accumulation: sums that cancel keep an error relative to their terms."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def _bound(spec, a, fa, b, fb, out_dtype):
    """The module doc's bound for einsum(spec, a, b) with a in fp8 format fa and b in fb."""

    def rounding(v, fmt):
        u, m = ROUNDING[fmt]
        s = 2.0 ** math.frexp(float(np.abs(v).max()) / float(jnp.finfo(fmt).max))[1]
        return np.maximum(u * np.abs(v), s * 2.0**-m)

    (a_dims, b_dims), out_dims = spec.split("->")[0].split(","), spec.split("->")[1]
    size = dict(zip(a_dims, a.shape, strict=True)) | dict(zip(b_dims, b.shape, strict=True))
    k = math.prod(size[d] for d in set(a_dims + b_dims) - set(out_dims))  # products summed per result
    ea, eb, aa, ab = rounding(a, fa), rounding(b, fb), np.abs(a), np.abs(b)
    exact = np.einsum(spec, aa, ab)
    out_ulp = float(jnp.finfo(out_dtype).eps) / 2
    rounded = np.einsum(spec, ea, ab) + np.einsum(spec, aa, eb) + np.einsum(spec, ea, eb)
    return rounded + (k * 2.0**-24 + out_ulp) * exact


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_op_error_within_the_fp8_rounding_bound(dtype):
    """Against exact dots of the unquantized operands: forward (e4m3 × e4m3) and both gradients
    (e5m2 × e4m3) stay inside the elementwise bound; the error is also far above fp32 noise, so
    the operands were quantized."""
    x, weights, grads = _inputs(dtype)
    outs, dx, dws = _fp8_op(x, weights, grads)
    fwd, bwd_x, bwd_w = _einsums(SPEC)
    x64 = np.asarray(x, np.float64)
    dx_exact, dx_bound = 0, 0
    for w, g, out, dw in zip(weights, grads, outs, dws, strict=True):
        w64, g64 = np.asarray(w.astype(dtype), np.float64), np.asarray(g, np.float64)
        for got, exact, bound in (
            (out, np.einsum(fwd, x64, w64), _bound(fwd, x64, E4M3, w64, E4M3, dtype)),
            (dw, np.einsum(bwd_w, x64, g64), _bound(bwd_w, x64, E4M3, g64, E5M2, dtype)),
        ):
            assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)
            assert np.linalg.norm(np.asarray(got, np.float64) - exact) > 1e-3 * np.linalg.norm(exact)
        dx_exact = dx_exact + np.einsum(bwd_x, g64, w64)
        dx_bound = dx_bound + _bound(bwd_x, g64, E5M2, w64, E4M3, dtype)
    dx_bound += float(jnp.finfo(dtype).eps) * np.abs(dx_exact)  # the sum of the two terms, rounded
    assert np.all(np.abs(np.asarray(dx, np.float64) - dx_exact) <= dx_bound)


def test_amax_reduces_over_the_axes_a_tensor_is_split_on_and_never_over_stages():
    """Inside a shard_map over stage × data × tensor, each device's scale is that of the whole
    tensor its stage holds (split over data and tensor); 'local' keeps each shard's own."""
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    # per stage a [4, 8] tensor, rows split over data, columns over tensor; shards differ in size
    # by factors of 2^k, so their own scales differ from the whole tensor's
    a = np.ones((2, 4, 8), np.float32) * (2.0 ** -np.arange(8))[None, None, :]
    a[0, :2] *= 64.0
    a[1, 2:, :4] *= 1024.0

    def scales(reduce):
        def per_device(a):
            return quantize(a, E4M3, reduce).scale[None, None, None]

        spec = P("stage", "data", "tensor")
        return np.asarray(jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec))(a))

    whole = [2.0 ** math.frexp(float(np.abs(a[s]).max()) / 448)[1] for s in range(2)]
    np.testing.assert_array_equal(scales(True), np.broadcast_to(np.array(whole)[:, None, None], (2, 2, 2)))
    local = scales(False)
    assert len(np.unique(local)) > 2, local  # shards of one stage differ without the reduction


def test_the_seven_dense_projections_and_nothing_else_run_in_fp8():
    """A layer quantizes to e4m3 its two normed inputs (once for q|k|v, once for gate|up), the
    attention and MLP outputs going into o_proj and down, and its seven weights; and to e5m2 the
    seven output gradients. Attention scores, PV, embedding and head add none."""
    cfg = _fp8_config(num_layers=2, qkv_share_every=2)
    params = params_of(Decoder(cfg.model, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((2, 8), jnp.int32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: Model(cfg.model).logits(p, tokens).mean()))(params))
    layers_in_scan_body = 2
    assert jaxpr.count("new_dtype=float8_e4m3fn") == (4 + 7) * layers_in_scan_body
    assert jaxpr.count("new_dtype=float8_e5m2") == 7 * layers_in_scan_body


def _batch(cfg):
    w = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


def _fp8_config(fp8=True, **model):
    """Head dim 16: FP8 GEMMs need multiples of 16."""
    cfg = small_config(num_heads=4, num_kv_heads=2, **model)
    cfg = cfg.updated(model=dict(fp8=dict(enabled=fp8)))
    return cfg


def _train(cfg, steps):
    """`steps` train steps on one batch: their losses (the first at the initial params), Adam's
    first moment after the first (its gradient, scaled) and the params' updates after all of them,
    a pipeline's in the canonical view."""
    mesh = make_mesh(cfg.parallel, jax.devices()[: math.prod(cfg.parallel.sizes.values())])
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state, step = init_state(run), compile_train_step(run)
        initial = jax.device_get(state["params"])
        batch = jax.device_put(_batch(cfg), batch_sharding(mesh))
        losses, moments = [], []
        for _ in range(steps):
            state, metrics = step(state, batch)
            assert float(metrics["lr"]) > 0 and int(metrics["skipped"]) == 0
            losses.append(float(metrics["loss"]))
            moments.append(jax.device_get(first_moment(state["opt_state"])))
        params = jax.device_get(state["params"])
    trees = [moments[0], initial, params]
    if run.schedule is not None:
        for tree in trees:
            tree["groups"] = canonical_view(tree["groups"])
    return SimpleNamespace(losses=losses, gradient=trees[0], updates=updates(trees[2], trees[1]))


def _assert_same_training(got, want, bound):
    """The initial loss within fp32 noise and later ones within 0.2%; per parameter, the first
    step's gradient and what two steps changed within `bound`."""
    assert_leaves_within(got.gradient, want.gradient, bound, "the first step's gradients")
    assert_leaves_within(got.updates, want.updates, bound, "the params' updates")
    np.testing.assert_allclose(got.losses[0], want.losses[0], rtol=1e-6)
    np.testing.assert_allclose(got.losses, want.losses, rtol=2e-3)


@pytest.fixture(scope="module")
def fp8_single():
    return _train(proportional_updates(_fp8_config()), 2)


@pytest.mark.parametrize("layout", [dict(tensor=2), dict(data=2, tensor=2)], ids=["tensor2", "data2xtensor2"])
def test_fp8_trains_alike_on_every_layout(layout, fp8_single):
    """Two steps whose updates follow the gradients (see `proportional_updates`) against the
    single device's. Not to fp32 noise: XLA:CPU's YNNPACK fusions run this step's fp8 dots and
    amaxes differently on another layout (with --xla_cpu_experimental_ynn_fusion_type= the layouts
    agree to 3e-7), which moves gradients by up to 1.8% and two steps' updates by 3% here."""
    cfg = proportional_updates(_fp8_config())
    cfg = cfg.updated(parallel=layout)
    _assert_same_training(_train(cfg, 2), fp8_single, bound=0.06)


@pytest.mark.parametrize(
    "schedule, repeats", [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_zero_bubble", 2)]
)
def test_fp8_pipeline_matches_gradient_accumulation(schedule, repeats):
    """amax is per microbatch: a pipeline of M microbatches (data-parallel inside its loop, where
    the pmax over `data` makes each microbatch's amax whole), GPipe's loop or a timetable, against
    grad_accum_steps = M, to fp32 noise (4e-7 here) in every gradient and in two updates that
    follow them."""
    share = 2 // repeats  # a QKV group a chunk
    pipelined = proportional_updates(_fp8_config(qkv_share_every=share))
    pipelined = pipelined.updated(parallel=dict(stage=2, microbatches=2, data=4, schedule=schedule, repeats=repeats))
    accumulated = proportional_updates(_fp8_config(qkv_share_every=share))
    accumulated = accumulated.updated(parallel=dict(data=4), train=dict(grad_accum_steps=2))
    _assert_same_training(_train(pipelined, 2), _train(accumulated, 2), bound=1e-5)


def test_fp8_training_tracks_the_same_run_without_it():
    """30 bf16 steps with FP8 projections against the same run without: every loss within 3%
    (2.1% at most here), and it learns."""
    runs = {fp8: _train(_fp8_config(fp8, dtype="bfloat16"), 30).losses for fp8 in (False, True)}
    np.testing.assert_allclose(runs[True], runs[False], rtol=3e-2)
    assert runs[True][-1] < 0.8 * runs[True][0]


@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_no_fp32_matmul_result_is_saved_for_the_backward_pass(policy):
    """A bf16 layer with FP8 projections under each remat policy: besides the scalar scales, no
    fp32 array from the FP8 op is kept (its dots accumulate in fp32 but return bf16)."""
    cfg = _fp8_config(dtype="bfloat16")
    project = fp8_projections("global")
    k = jax.random.split(jax.random.key(0), 8)
    x = jax.random.normal(k[0], (2, 16, 64), jnp.bfloat16)
    qkv = {
        name: jax.random.normal(key, (64, n, 16)) * 0.05 for name, key, n in zip("qkv", k[1:4], (4, 2, 2), strict=True)
    }
    mlp = {"gate": jax.random.normal(k[4], (64, 128)), "up": jax.random.normal(k[5], (64, 128)),
           "down": jax.random.normal(k[6], (128, 64))}  # fmt: skip
    o_proj = jax.random.normal(k[7], (4, 16, 64))
    rope = layers.make_context(jnp.zeros((2, 16), jnp.int32), None, None, 16, 1e4).rope
    wrap_layer, wrap_group = _remat_wrappers(policy)

    @wrap_group
    def group(x, qkv, o_proj, mlp):
        @wrap_layer
        def layer(x, qkv, o_proj, mlp):
            x = x + layers.attention(x, qkv, o_proj, rope, None, project=project)
            return x + layers.feed_forward(x, mlp, activation=cfg.model.mlp_activation, project=project)

        return layer(layer(x, qkv, o_proj, mlp), qkv, o_proj, mlp)

    saved = saved_residuals(lambda *a: group(*a).astype(jnp.float32).sum(), x, qkv, o_proj, mlp)
    from_op = [(aval, where) for aval, where in saved if "fp8.py" in where]
    fp32 = [(aval, where) for aval, where in from_op if aval.dtype == jnp.float32 and aval.shape]
    assert not fp32, fp32
    if policy == "none":
        assert {aval.dtype for aval, _ in from_op} >= {jnp.dtype(E4M3)}, "no fp8 operand kept"


def test_the_start_up_summary_says_whether_fp8_is_on():
    assert "dense projections FP8 (e4m3 forward, e5m2 gradients" in summary(_fp8_config())
    assert "FP8" not in summary(_fp8_config(fp8=False))


def test_fp8_adds_no_train_state():
    """Current scaling keeps no scales: the train state (and so a checkpoint) is the same with and
    without FP8."""
    mesh = make_mesh(_fp8_config().parallel, jax.devices()[:1])
    runs = [build_run(_fp8_config(fp8), mesh) for fp8 in (False, True)]
    shapes = [jax.eval_shape(lambda r=r: init_state(r)) for r in runs]
    assert jax.tree.structure(shapes[0]) == jax.tree.structure(shapes[1])
    assert jax.tree.leaves(shapes[0]) == jax.tree.leaves(shapes[1])
