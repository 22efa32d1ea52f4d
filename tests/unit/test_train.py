"""Training: accumulation and remat change nothing numerically; a step equals an independent optimizer."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.compare import assert_leaves_within, first_moment, leaf_errors
from support.faults import poisoned
from support.runs import small_config

from jaxllm.config import REMAT_POLICIES
from jaxllm.model import Model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.faults import NonFiniteSteps
from jaxllm.train.optim import learning_rate
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_train_step, init_params, init_state, mean_loss


def _batch(cfg, seed=1):
    w = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


def _two_steps(cfg):
    """Two optimizer steps on two batches: (losses, gradient norms, Adam's first moment after the
    first step: its gradient scaled, params after both)."""
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state, step = init_state(run), compile_train_step(run)
        metrics, moments = [], []
        for seed in (1, 2):
            state, m = step(state, jax.device_put(_batch(cfg, seed), batch_sharding(mesh)))
            metrics.append(jax.device_get(m))
            moments.append(jax.device_get(first_moment(state["opt_state"])))
        assert all(m["lr"] > 0 for m in metrics)
        losses, norms = ([float(m[k]) for m in metrics] for k in ("loss", "grad_norm"))
        return losses, norms, moments[0], jax.device_get(state["params"])


def test_gradient_accumulation_equals_one_big_batch():
    """4 microsteps against one batch of all their rows: every parameter's gradient within fp32
    noise, and the params after two real updates within a tenth of a step (see test_layouts.py:
    Adam magnifies reduction-order noise on near-zero gradients)."""
    cfg = small_config()
    cfg = cfg.updated(parallel=dict(data=2, tensor=4), train=dict(batch_size=16))
    want = _two_steps(cfg)
    got = _two_steps(cfg.updated(train=dict(grad_accum_steps=4)))
    assert_leaves_within(got[2], want[2], 1e-5, "the first step's gradients")
    chex.assert_trees_all_close(got[3], want[3], atol=0.1 * cfg.train.lr)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5)  # the second step's params differ by noise


def test_bf16_accumulation_of_32_microsteps_rounds_no_weight_gradient_to_bf16():
    """bf16 compute, 32 microsteps against one batch of all their rows, as test_pipeline.py's M=32
    test: every leaf differs by bf16's forward noise (the norms' and embedding's gradients, never a
    bf16 dot's result, set that floor); a projection's weight gradient rounded to bf16 per microstep
    before the fp32 sum would sit well above it. Bound: every projection leaf within 1.5× the
    largest other leaf."""
    cfg = small_config(num_layers=4, qkv_share_every=2, dtype="bfloat16")
    cfg = cfg.updated(parallel=dict(data=8), train=dict(batch_size=256, seq_len=16))
    want = _two_steps(cfg)[2]
    got = _two_steps(cfg.updated(train=dict(grad_accum_steps=32)))[2]
    projection = jax.tree.map(lambda s: s.quantizable, Model(cfg.model).specs, is_leaf=lambda x: hasattr(x, "axes"))
    errors = leaf_errors(got, want)
    kinds = dict(zip(errors, jax.tree.leaves(projection), strict=True))
    floor = max(e for name, e in errors.items() if not kinds[name])
    assert max(e for name, e in errors.items() if kinds[name]) <= 1.5 * floor, errors


def test_remat_policies_give_the_same_gradients():
    cfg = small_config()
    cfg = cfg.updated(parallel=dict(fsdp=2, tensor=4))
    mesh = make_mesh(cfg.parallel)
    results = {}
    with jax.set_mesh(mesh):
        params = init_state(build_run(cfg, mesh))["params"]
        batch = jax.device_put(_batch(cfg), batch_sharding(mesh))
        for policy in REMAT_POLICIES:
            model = Model(cfg.model.replace(remat=policy))
            results[policy] = jax.jit(jax.value_and_grad(lambda p, b, m=model: mean_loss(p, b, m)))(params, batch)
    for policy, (loss, grads) in results.items():
        np.testing.assert_allclose(loss, results["none"][0], rtol=1e-6, err_msg=policy)
        jax.tree.map(
            lambda a, b, p=policy: np.testing.assert_allclose(a, b, atol=1e-7, err_msg=p), grads, results["none"][1]
        )


def test_remat_policies_keep_less_in_order():
    """Compiled temporaries of the gradient at seq 64 (saved activations dominate): none keeps
    every activation, dots the matmul outputs, selective the named ones, full each layer's input,
    group one input per shared-QKV group."""
    cfg = small_config(num_layers=8, qkv_share_every=2)
    cfg = cfg.updated(train=dict(seq_len=64, batch_size=2))
    params, batch = init_params(cfg), _batch(cfg)
    temporaries = {}
    for policy in ("none", "dots", "selective", "full", "group"):
        model = Model(cfg.model.replace(remat=policy))
        grad = jax.jit(jax.grad(lambda p, m=model: mean_loss(p, batch, m))).lower(params).compile()
        temporaries[policy] = grad.memory_analysis().temp_size_in_bytes
    sizes = list(temporaries.values())
    assert all(a > b for a, b in zip(sizes, sizes[1:], strict=False)), temporaries


def test_non_finite_step_leaves_params_and_optimizer_untouched():
    cfg = small_config()
    cfg = cfg.updated(parallel=dict(data=8))
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        state = init_state(build_run(cfg, mesh))
        before = jax.device_get({k: state[k] for k in ("params", "opt_state")})  # the step donates `state`
        step = compile_train_step(build_run(cfg, mesh))
        clean = _batch(cfg) | {"loss_mask": np.ones((cfg.train.batch_size, cfg.train.seq_len), np.float32)}
        state, metrics = step(state, jax.device_put(poisoned(clean), batch_sharding(mesh)))
        batch = jax.device_put(clean, batch_sharding(mesh))
        assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
        assert int(state["step"]) == 1
        chex.assert_trees_all_equal(jax.device_get({k: state[k] for k in ("params", "opt_state")}), before)
        state, metrics = step(state, batch)
        assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
        schedule = learning_rate(cfg.train)
        assert float(metrics["lr"]) == pytest.approx(float(schedule(0)))  # the skip did not advance the schedule
        state, metrics = step(state, batch)
        assert float(metrics["lr"]) == pytest.approx(float(schedule(1))) != float(schedule(0))  # an update did
        assert not np.array_equal(jax.device_get(state["params"]["embed"]), before["params"]["embed"])


class _Flag:
    """A step's skipped-update flag that records when the host reads it."""

    def __init__(self, step: int, value: int, reads: list):
        self.step, self.value, self.reads = step, value, reads

    def __int__(self):
        self.reads.append(self.step)
        return self.value


def test_non_finite_steps_are_counted_one_step_late_without_waiting_on_the_step_in_flight():
    reads = []
    steps = NonFiniteSteps(total=5, limit=2)
    flags = {1: 0, 2: 1, 3: 0, 4: 1, 5: 1, 6: 1}
    streaks = {}
    for step, value in flags.items():
        streaks[step] = steps.push(step, _Flag(step, value, reads))
        assert reads == list(range(1, step)), "only earlier steps' flags may be read"
    assert streaks == {1: None, 2: None, 3: None, 4: None, 5: None, 6: 4}  # steps 4 and 5: two in a row
    assert steps.total == 5 + 3 and steps.total_so_far() == 5 + 4  # the held step 6 counts once read
    assert steps.flush() == 4 and steps.in_a_row == 3 and steps.total == 5 + 4


def _reference_optimizer(train) -> optax.GradientTransformation:
    """The optimizer docs/training.md describes, written here from optax parts: clip by global norm,
    Adam, decoupled weight decay on everything but norm scales, linear warmup then cosine decay
    to `min_lr_ratio` of the peak at the last step."""

    def lr(count):
        warm = train.lr * count / train.warmup_steps
        progress = jnp.clip((count - train.warmup_steps) / (train.steps - train.warmup_steps), 0.0, 1.0)
        floor = train.lr * train.min_lr_ratio
        cosine = floor + (train.lr - floor) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < train.warmup_steps, warm, cosine)

    def decayed(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), params)

    return optax.chain(
        optax.clip_by_global_norm(train.clip_norm),
        optax.scale_by_adam(b1=train.b1, b2=train.b2, eps=train.eps),
        optax.add_decayed_weights(train.weight_decay, mask=decayed),
        optax.scale_by_learning_rate(lr),
    )


def test_four_training_steps_equal_an_independently_written_optimizer():
    cfg = small_config()
    # lr 0, half, all of the peak, then decaying
    cfg = cfg.updated(train=dict(steps=5, warmup_steps=2, lr=1e-2, weight_decay=0.5, clip_norm=0.05))
    mesh = make_mesh(cfg.parallel, jax.devices()[:1])
    batches = [_batch(cfg, seed) for seed in range(4)]
    with jax.set_mesh(mesh):
        state = init_state(build_run(cfg, mesh))
        params = jax.device_get(state["params"])
        step = compile_train_step(build_run(cfg, mesh))
        for batch in batches:
            state, _ = step(state, batch)
        got = jax.device_get(state["params"])
        grad_fn = jax.jit(jax.grad(lambda p, b: mean_loss(p, b, Model(cfg.model))))
        optimizer = _reference_optimizer(cfg.train)
        opt_state = optimizer.init(params)
        for batch in batches:
            grads = grad_fn(params, batch)
            assert optax.tree.norm(grads) > cfg.train.clip_norm, "clipping should be active"
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    # fp32 sums in another order (the step's projections take their weight gradients from their own
    # VJP) move an element whose Adam second moment is tiny by ~1e-6: a thousandth of a step at this
    # lr; a wrong decay, clip or schedule moves every parameter by 1e-4 or more.
    chex.assert_trees_all_close(got, jax.device_get(params), atol=1e-5)
