"""The train state's initialisation and the jitted train and eval steps (with gradient accumulation)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax

from jaxllm.checkpoint import read_into
from jaxllm.checkpoint.layout import from_canonical
from jaxllm.config import RunConfig
from jaxllm.model.decoder import Model
from jaxllm.model.int8 import quantize_tree
from jaxllm.model.lora import adapter_mask, combine, partition
from jaxllm.parallel.rules import activation_rules, rules_for
from jaxllm.parallel.schedule import split_microbatches
from jaxllm.train.optim import learning_rate
from jaxllm.train.run import Run, State, on_device

Batch = dict[str, jax.Array]  # 'inputs', 'targets', optional 'loss_mask', 'segment_ids', 'positions'


def loss_sums(
    params: dict, batch: Batch, model: Model, copies: dict | None = None, dropout: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross-entropy over unmasked tokens, number of unmasked tokens), in fp32;
    with LoRA dropout when given its key."""
    return model.loss_sums(params, batch, copies, dropout)


def mean_loss(params: dict, batch: Batch, model: Model) -> jax.Array:
    total, count = loss_sums(params, batch, model)
    return total / jnp.maximum(count, 1.0)


def init_params(cfg: RunConfig) -> dict:
    """The decoder's initial params with the run's seed, in the run's pipeline view."""
    return Model(cfg.model, cfg.parallel.pipeline).init(cfg.train.seed)


def init_state(run: Run) -> State:
    """Initialises params (from the seed, or from the weights at `init.hf`: a Hugging Face Llama, an
    export or a run; LoRA's adapters always from the seed) and a fresh optimizer state for the
    trained params, directly into their shardings. An int8 base (`model.quantize`) is quantized
    from those full-precision weights."""
    quantized = run.cfg.model.quantize is not None
    full = Model(run.cfg.model.replace(quantize=None), run.schedule) if quantized else run.model
    adapters = adapter_mask(full.specs)

    def init(loaded: dict | None) -> State:
        params = full.init(run.cfg.train.seed)  # what `loaded` replaces, the compiler leaves out
        if loaded is not None:
            params = combine(partition(params, adapters)[0], from_canonical(loaded, run.schedule))
        if quantized:
            params = quantize_tree(params, full.specs, run.model.specs)
        trained = partition(params, run.trained)[0]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": run.optimizer.init(trained)}

    hf = run.cfg.init.hf
    # The canonical params have the same keys as the run's own view: the mask fits both.
    loaded = None if hf is None else read_into(hf, partition(_full_precision(run), adapters)[1])
    return jax.jit(init, out_shardings=run.shardings)(loaded)


def _full_precision(run: Run) -> dict:
    """The run's canonical abstract params with each int8 weight ({"q", "scale"}) as the
    full-precision weight it is quantized from: what `init.hf` is read into."""
    dtype = jnp.dtype(run.cfg.model.param_dtype)

    def whole(p):
        if isinstance(p, dict) and set(p) == {"q", "scale"}:
            return jax.ShapeDtypeStruct(p["q"].shape, dtype, sharding=p["q"].sharding)
        return {k: whole(v) for k, v in p.items()} if isinstance(p, dict) else p

    return whole(run.canonical["params"])


def train_step(state: State, batch: Batch, run: Run) -> tuple[State, dict]:
    """One optimizer step over `grad_accum_steps` sequential microbatches. The loss is the mean over
    all unmasked tokens of the whole batch, whatever the accumulation."""
    with activation_rules(rules_for(run.cfg.parallel)):
        return _train_step(state, batch, run)


def _train_step(state: State, batch: Batch, run: Run) -> tuple[State, dict]:
    cfg = run.cfg
    model, accum = run.model, cfg.train.grad_accum_steps
    # Gradients of the trained params only (all, or LoRA's adapters): the frozen ones are constants.
    trained, frozen = partition(state["params"], run.trained)
    grad_fn = jax.value_and_grad(lambda t, *args: loss_sums(combine(t, frozen), *args), has_aux=True)
    copies = model.stage_copies(state["params"])  # a pipeline's FSDP gather: once per step
    # LoRA dropout's key: a function of the seed, the step and the microstep.
    dropout = jax.random.fold_in(jax.random.key(cfg.train.seed), state["step"]) if cfg.model.lora.dropout else None

    def accumulate(carry, xs):
        (total, count, grads), (micro, index) = carry, xs
        key = None if dropout is None else jax.random.fold_in(dropout, index)
        (loss, n), g = grad_fn(trained, micro, model, copies, key)
        grads = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, grads, g), run.grad_shardings)
        return (total + loss, count + n, grads), None

    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, trained), run.grad_shardings)
    micro = jax.tree.map(partial(split_microbatches, m=accum), batch)
    (total, count, grads), _ = jax.lax.scan(
        accumulate, (jnp.zeros(()), jnp.zeros(()), zeros), (micro, jnp.arange(accum))
    )
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    grad_norm = optax.tree.norm(grads)
    # A non-finite loss or gradient skips the update: params and optimizer state stay as they were.
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    opt_state = state["opt_state"]
    if cfg.parallel.offload_optimizer:  # in from host memory for the update; out_shardings send it back
        opt_state = jax.device_put(opt_state, on_device(run.shardings["opt_state"]))
    new_trained, new_opt_state = apply_optimizer(run.optimizer, grads, trained, opt_state, finite)
    new_state = {"step": state["step"] + 1, "params": combine(new_trained, frozen), "opt_state": new_opt_state}
    metrics = {
        "loss": total / count,
        "grad_norm": grad_norm,
        # The schedule follows applied updates (a skipped step does not advance it, as in Megatron).
        "lr": learning_rate(cfg.train)(optax.tree_utils.tree_get_all_with_path(opt_state, "count")[0][1]),
        "tokens": count,
        "skipped": 1 - finite.astype(jnp.int32),
    }
    return new_state, metrics


def apply_optimizer(
    optimizer: optax.GradientTransformation, grads: dict, params: dict, opt_state, apply: jax.Array
) -> tuple[dict, object]:
    """(new params, new optimizer state) where `apply`, else the old ones untouched, written in
    place over the donated old state.

    A `cond`, not a select of new against old: with a select the compiler fuses the moments'
    update into the params' update too, which then reads the old moments while their own update
    overwrites them, so it copies every moment (twice the params' bytes: 8.3 GiB more peak per
    device for 120B). A GPU reads the predicate on the host, once per step, before the update.
    """

    def update(params, opt_state):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.lax.cond(apply, update, lambda *state: state, params, opt_state)


def eval_step(params: dict, batch: Batch, run: Run) -> tuple[jax.Array, jax.Array]:
    """(loss sum, token count) of a batch under the current params."""
    with activation_rules(rules_for(run.cfg.parallel)):
        return loss_sums(params, batch, run.model)


def compile_eval_step(run: Run):
    return jax.jit(partial(eval_step, run=run), in_shardings=(run.shardings["params"], run.batch_sharding))


def compile_train_step(run: Run):
    """The jitted step with explicit in/out shardings; the old state is donated."""
    return jax.jit(
        partial(train_step, run=run),
        in_shardings=(run.shardings, run.batch_sharding),
        out_shardings=(run.shardings, None),
        donate_argnums=0,
    )
