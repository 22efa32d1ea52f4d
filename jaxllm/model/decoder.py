"""The decoder as Flax NNX modules: embedding → scanned stack of shared-QKV layer groups → final
norm → LM head.

`Decoder` holds every layer group stacked in one `LayerGroup` (leading dim: the group, or with a
pipeline schedule [repeats, stages, groups per stage]). Its forward pass crosses each JAX boundary
(`lax.scan` over groups, `jax.checkpoint` per layer or group, the pipeline's `shard_map`) with the
plain dict of the slice it needs and rebinds that dict to the module's graph inside: no NNX
transforms, and compile time does not grow with depth.

    model = Decoder(cfg.model, rngs=nnx.Rngs(0))   # the trainer's init with seed 0
    logits = model(tokens)                          # no mesh needed
    params = params_of(model)                       # the plain dict checkpoints hold
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import TABLE_SCHEDULES, ModelConfig, Schedule
from jaxllm.model import layers
from jaxllm.model.blocks import UNSTACKED, Attention, DecoderLayer, Norm, Stack
from jaxllm.model.cache import KVCache
from jaxllm.model.params import Params, declare, init_params, params_of, specs_of
from jaxllm.parallel.pipeline import gather_stage_weights, pipeline_stack
from jaxllm.parallel.rules import AXIS_RULES, constrain
from jaxllm.parallel.scheduled import scheduled_loss
from jaxllm.parallel.tensor_parallel import RESIDUAL, vocab_split_summed_loss

# Activations that the 'selective' policy keeps (and 'offload' moves to host) instead of recomputing.
SAVED_NAMES = ("layer_input", "qkv_proj", "attn_out", "mlp_in", "mlp_out")


def _remat_wrappers(policy: str) -> tuple[Callable, Callable]:
    """(layer wrapper, group wrapper) implementing a named remat policy."""
    cp = jax.checkpoint_policies
    layer_policies = {
        "full": cp.nothing_saveable,
        "selective": cp.save_only_these_names(*SAVED_NAMES),
        "dots": cp.checkpoint_dots,
        "offload": cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(SAVED_NAMES),
            offload_src="device",
            offload_dst="pinned_host",
        ),
    }

    def keep(f):
        return f

    if policy == "none":
        return keep, keep
    if policy == "group":
        return keep, partial(jax.checkpoint, policy=cp.nothing_saveable)
    return partial(jax.checkpoint, policy=layer_policies[policy]), keep


class LayerGroup(nnx.Module):
    """`qkv_share_every` consecutive layers and the one QKV projection (`Attention`) they all apply."""

    def __init__(self, model: ModelConfig, stack: Stack = UNSTACKED):
        lead, lead_axes = stack
        self.remat, self.size = model.remat, model.qkv_share_every
        self.qkv = Attention(model, stack)
        self.layers = DecoderLayer(model, ((*lead, self.size), (*lead_axes, "sublayers")))

    def __call__(self, x: jax.Array, ctx: layers.Context) -> jax.Array:
        """One group: its QKV unstacked, its layers stacked on the leading dim."""
        wrap_layer, _ = _remat_wrappers(self.remat)
        qkv_graph, layer_graph = nnx.graphdef(self.qkv), nnx.graphdef(self.layers)

        @wrap_layer
        def layer(x, qkv: Params, params: Params, ctx):
            return nnx.merge(layer_graph, params)(x, nnx.merge(qkv_graph, qkv), ctx)

        qkv, stacked = params_of(self.qkv), params_of(self.layers)
        for i in range(self.size):
            x = layer(x, qkv, jax.tree.map(lambda a, i=i: a[i], stacked), ctx.folded(i))
        return x


def scan_layers(graph: nnx.GraphDef, groups: Params, x: jax.Array, ctx: layers.Context, cache: KVCache):
    """Applies stacked groups with a KV cache (generation) as one scan over every layer, carrying
    the cache's pools: (output, cache). Each step reads its layer's weights where they lie; a slice
    of a group's stack, as training takes, would copy them at every memory-bound decode step."""
    stacked = nnx.merge(graph, groups)  # a LayerGroup whose arrays keep their leading group dim
    qkv_graph, layer_graph = nnx.graphdef(stacked.qkv), nnx.graphdef(stacked.layers)
    qkv, share = params_of(stacked.qkv), stacked.size
    every_layer = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), params_of(stacked.layers))

    def step(carry, xs):
        (x, pools), (params, index) = carry, xs
        attention = nnx.merge(qkv_graph, jax.tree.map(lambda a: a[index // share], qkv))
        layer_cache = cache._replace(keys=pools[0], values=pools[1])
        x, pools = nnx.merge(layer_graph, params)(x, attention, ctx, (layer_cache, index))
        return (x, pools), None

    count = jax.tree.leaves(every_layer)[0].shape[0]
    (x, (keys, values)), _ = jax.lax.scan(step, (x, (cache.keys, cache.values)), (every_layer, jnp.arange(count)))
    return x, cache._replace(keys=keys, values=values)


def scan_groups(
    graph: nnx.GraphDef, remat: str, groups: Params, x: jax.Array, ctx: layers.Context, unrolled: bool = False
) -> jax.Array:
    """Applies stacked groups (a `LayerGroup` graph, params with a leading group dim) in order, in
    a scan, or `unrolled` in a Python loop (a split backward, `parallel/split_backward.py`, needs
    flat equations)."""
    _, wrap_group = _remat_wrappers(remat)
    body = wrap_group(lambda x, params, ctx: nnx.merge(graph, params)(x, ctx))

    def step(x, group):
        params, index = group
        return body(x, params, ctx.folded(index)), None

    count = jax.tree.leaves(groups)[0].shape[0]
    if unrolled:
        for index in range(count):
            x, _ = step(x, (jax.tree.map(lambda a, i=index: a[i], groups), index))
        return x
    x, _ = jax.lax.scan(step, x, (groups, jnp.arange(count)))
    return x


def head_projection(model: ModelConfig, head: Params, x: jax.Array) -> jax.Array:
    """fp32 logits of the final norm's `head["norm"]` and the output projection `head["matrix"]`,
    over the vocabulary the matrix holds (all of it, or a device's block), padding unmasked."""
    x = layers.norm(x, head["norm"], model.norm, model.norm_eps)
    return jnp.einsum("bte,ev->btv", x, head["matrix"].astype(model.dtype), preferred_element_type=jnp.float32)


def head_logits(model: ModelConfig, head: Params, x: jax.Array) -> jax.Array:
    """fp32 logits [batch, seq, padded_vocab] (`head_projection`); padded vocab entries are masked
    to NEG_INF."""
    logits = constrain(head_projection(model, head, x), "batch", "head_seq", "vocab")
    return jnp.where(jnp.arange(model.padded_vocab) < model.vocab_size, logits, layers.NEG_INF)


def summed_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Next-token cross-entropy of `targets` [batch, seq] summed over the tokens `mask` weighs, in fp32."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((lse - target_logit) * mask.astype(jnp.float32))


class Decoder(nnx.Module):
    """Decoder-only LM. Initial values are a pure function of the seed in `rngs` (its `params`
    stream's key) and each parameter's path: `Decoder(model, rngs=nnx.Rngs(s))` holds exactly the
    trainer's init with seed `s`, on any mesh, whatever RNG draws came before."""

    def __init__(self, model: ModelConfig, *, rngs: nnx.Rngs, schedule: Schedule | None = None):
        self.model, self.schedule = model, schedule
        vocab, h, dt, std = model.padded_vocab, model.hidden, model.param_dtype, model.init_std
        self.embed = declare((vocab, h), ("vocab", "embed"), dt, std=std)
        groups = model.groups
        if schedule is None:
            stack = ((groups,), ("layers",))
        else:
            r, s = schedule.repeats, schedule.stages
            stack = ((r, s, groups // (r * s)), ("repeats", "stages", "layers"))
        self.groups = LayerGroup(model, stack)
        self.final_norm = Norm(model)
        if not model.tie_embeddings:
            self.lm_head = declare((h, vocab), ("embed", "vocab"), dt, std=std)
        nnx.update(self, init_params(specs_of(self), rngs.params.key.get_value(), jnp.dtype(dt)))

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        copies: Params | None = None,
        dropout: jax.Array | None = None,
    ) -> jax.Array:
        """fp32 logits [batch, seq, padded_vocab]; padded vocab entries are masked to NEG_INF. A
        pipelined decoder computes with `copies` (see `Model.stage_copies`), or gathers its own.
        `dropout`: a key for LoRA dropout (`model.lora.dropout`), given while training."""
        x, ctx = self._embed(tokens, segment_ids, positions)
        return self._head(self._stack(x, ctx._replace(dropout=dropout), copies))

    def loss_sums(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        mask: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        copies: Params | None = None,
        dropout: jax.Array | None = None,
    ) -> jax.Array:
        """The next-token cross-entropy of `targets`, summed over the tokens `mask` weighs, in fp32.
        A pipeline run by a timetable (1F1B) computes it inside its loop, the head included."""
        if self.schedule is None or self.schedule.kind not in TABLE_SCHEDULES:
            x, ctx = self._embed(tokens, segment_ids, positions)
            return summed_loss(self._head(self._stack(x, ctx._replace(dropout=dropout), copies)), targets, mask)
        ctx = self._context(tokens, segment_ids, positions)._replace(dropout=dropout)
        specs = specs_of(self.groups)
        groups, graph = params_of(self.groups), nnx.graphdef(self.groups)
        if copies is None:
            copies = gather_stage_weights(groups, specs, jnp.dtype(self.model.dtype))

        stack_fn = partial(scan_groups, graph, self.model.remat, unrolled=self.schedule.split)

        def forward_loss(groups, head, table, copies, tokens, ctx, targets, mask):  # GPipe's loop, forward only
            x, ctx = self._lookup(table, tokens), ctx._replace(rope=self._rope(ctx.positions))
            out = pipeline_stack(groups, specs, x, ctx, self.schedule, stack_fn, copies)
            return summed_loss(head_logits(self.model, head, out), targets, mask)

        return scheduled_loss(
            groups, specs, self._head_params(), self.embed.get_value(), tokens, ctx, targets, mask, self.schedule,
            stack_fn, self._vocab_split_loss, copies, forward_loss, jnp.dtype(self.model.dtype), self._rope,
        )  # fmt: skip

    def extend(
        self, tokens: jax.Array, positions: jax.Array | None, cache: KVCache, logits_at: jax.Array | None = None
    ) -> tuple[jax.Array, KVCache]:
        """With a KV cache (one page table row per batch row): the tokens sit at `positions`
        (consecutive per row, -1 for padding; 0, 1, ... by default) after what the cache holds,
        their keys and values are written into its pages; (logits, cache). With `logits_at`
        [batch], only the logits at that index of each row: [batch, 1, padded_vocab]."""
        if self.schedule is not None:
            raise ValueError("a KV cache needs the plain stack: load the params without a pipeline schedule")
        x, ctx = self._embed(tokens, None, positions)
        x, cache = scan_layers(nnx.graphdef(self.groups), params_of(self.groups), x, ctx, cache)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        return self._head(x), cache

    def _embed(self, tokens, segment_ids, positions) -> tuple[jax.Array, layers.Context]:
        return self._lookup(self.embed.get_value(), tokens), self._context(tokens, segment_ids, positions)

    def _context(self, tokens, segment_ids, positions) -> layers.Context:
        model = self.model
        return layers.make_context(tokens, segment_ids, positions, model.head_dim, model.rope_theta, model.rope_scaling)

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = self.model
        return layers.rope_tables(
            positions, layers.rope_frequencies(model.head_dim, model.rope_theta, model.rope_scaling)
        )

    def _lookup(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        # Gather the table's FSDP shards first (as for any weight), then look up vocab-sharded rows
        # of the fp32 table: the lookup's gradient adds every occurrence of a token into its row,
        # which in bf16 would stop growing after a few hundred occurrences.
        table = constrain(table, "vocab", None)
        return constrain(jnp.take(table, tokens, axis=0).astype(self.model.dtype), *RESIDUAL)

    def _head_params(self) -> Params:
        matrix = self.embed.get_value().T if self.model.tie_embeddings else self.lm_head.get_value()
        return {"norm": params_of(self.final_norm), "matrix": matrix}

    def _vocab_split_loss(self, head: Params, x: jax.Array, targets: jax.Array, mask: jax.Array, axes) -> jax.Array:
        """The loss inside a pipeline loop, where `head["matrix"]` is this device's block of the
        vocabulary split over the mesh `axes`."""
        logits = head_projection(self.model, head, x)
        return vocab_split_summed_loss(logits, targets, mask, self.model.vocab_size, layers.NEG_INF, axes)

    def _head(self, x: jax.Array) -> jax.Array:
        return head_logits(self.model, self._head_params(), x)

    def _stack(self, x: jax.Array, ctx: layers.Context, copies: Params | None) -> jax.Array:
        graph, groups = nnx.graphdef(self.groups), params_of(self.groups)
        run = partial(scan_groups, graph, self.model.remat)
        if self.schedule is None:
            return run(groups, x, ctx)
        specs = specs_of(self.groups)
        if copies is None:
            copies = gather_stage_weights(groups, specs, jnp.dtype(self.model.dtype))
        return pipeline_stack(groups, specs, x, ctx, self.schedule, run, copies)


def _check_matches(specs: dict, params: Params) -> None:
    """Names every parameter that is missing, unexpected or of another shape."""
    want = {jax.tree_util.keystr(p, simple=True, separator="/"): s.shape for p, s in _leaves(specs)}
    got = {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(a.shape) for p, a in _leaves(params)}
    problems = [f"missing {k}" for k in want.keys() - got.keys()]
    problems += [f"unexpected {k}" for k in got.keys() - want.keys()]
    problems += [f"{k} has shape {got[k]}, the model needs {want[k]}" for k in want.keys() & got.keys()
                 if got[k] != want[k]]  # fmt: skip
    if problems:
        raise ValueError(
            "params do not fit this model config: " + "; ".join(sorted(problems)) + ". Pass the config they were "
            "saved with (an export's config.json, a checkpoint's meta) and the same pipeline schedule or none"
        )


def _leaves(tree) -> list:
    return jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))


class Model:
    """The decoder as one run or engine uses it, built once: its modules' graph definition (kept)
    and their parameter specs (a view of the modules' abstract state). Each entry point rebinds
    the graph to the plain dict of params it is given (`nnx.merge`), so jitted functions see
    plain dicts, and no module tree is built while they trace.

        model = Model(cfg.model)                    # or Model(cfg.model, cfg.parallel.pipeline)
        params = model.init(seed=0)                 # the trainer's initial weights for train.seed=0
        logits = model.logits(params, tokens)       # training and evaluation
        logits, cache = model.prefill(params, prompt, KVCache.empty(cfg.model, 1, 64))
        logits, cache = model.decode_step(params, token, position, cache)
    """

    def __init__(self, config: ModelConfig, schedule: Schedule | None = None):
        self.config, self.schedule = config, schedule
        with nnx.logical_axis_rules(AXIS_RULES):  # each abstract value carries its sharding, under a mesh
            abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), schedule=schedule))
        self.graph, self.specs = nnx.graphdef(abstract), specs_of(abstract)

    def init(self, seed: int) -> Params:
        """Initial params: a pure function of `seed` and each parameter's path (see `Decoder`)."""
        return params_of(Decoder(self.config, rngs=nnx.Rngs(seed), schedule=self.schedule))

    def bind(self, params: Params) -> Decoder:
        """The modules holding `params` (a plain dict: the train state's, a checkpoint's); refused,
        naming each parameter, if they do not fit."""
        _check_matches(self.specs, params)
        return nnx.merge(self.graph, params)

    def logits(
        self,
        params: Params,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        copies: Params | None = None,
        dropout: jax.Array | None = None,
    ) -> jax.Array:
        """fp32 logits [batch, seq, padded_vocab] (see `Decoder.__call__`). With a pipeline
        schedule, params hold the groups in its view, and `copies` may hold their `stage_copies`."""
        return self.bind(params)(tokens, segment_ids, positions, copies, dropout)

    def loss_sums(
        self, params: Params, batch: dict, copies: Params | None = None, dropout: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(sum of next-token cross-entropy over unmasked tokens, number of unmasked tokens), in
        fp32, of a batch ('inputs', 'targets', optional 'loss_mask', 'segment_ids', 'positions');
        with LoRA dropout when given its key."""
        mask = batch.get("loss_mask", jnp.ones_like(batch["targets"])).astype(jnp.float32)
        total = self.bind(params).loss_sums(
            batch["inputs"], batch["targets"], mask, batch.get("segment_ids"), batch.get("positions"), copies, dropout
        )
        return total, jnp.sum(mask)

    def extend(
        self,
        params: Params,
        tokens: jax.Array,
        positions: jax.Array | None,
        cache: KVCache,
        logits_at: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """`tokens` [batch, t] at `positions` (-1: padding; None: 0, 1, ...) into the cache's pages
        after what they hold: (logits, cache); see `Decoder.extend`."""
        return self.bind(params).extend(tokens, positions, cache, logits_at)

    def prefill(
        self, params: Params, tokens: jax.Array, cache: KVCache, logits_at: jax.Array | None = None
    ) -> tuple[jax.Array, KVCache]:
        """A prompt into an empty cache, from position 0: (logits, cache)."""
        return self.extend(params, tokens, None, cache, logits_at)

    def decode_step(
        self, params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """One token per row, at `positions` [batch, 1], after what the cache holds: (logits, cache)."""
        return self.extend(params, tokens, positions, cache)

    def stage_copies(self, params: Params) -> Params | None:
        """What a pipeline's loop computes with: its stage weights in the compute dtype, gathered
        over `fsdp` (see `gather_stage_weights`); None without a pipeline. A train step builds them
        once and passes them to each accumulation microstep's `logits`."""
        if self.schedule is None:
            return None
        return gather_stage_weights(params["groups"], self.specs["groups"], jnp.dtype(self.config.dtype))
