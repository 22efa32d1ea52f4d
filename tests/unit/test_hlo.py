"""The compiled HLO of tensor-parallel layers: Megatron's all-reduce pattern and no weight gathers."""

import re

import jax
import jax.numpy as jnp
from flax import nnx
from support.runs import small_config

from jaxllm.model import Model
from jaxllm.model.layers import make_context
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import activation_rules, constrain, rules_for
from jaxllm.parallel.tensor_parallel import RESIDUAL
from jaxllm.train.run import build_run
from jaxllm.train.step import init_params


def _count(hlo: str, op: str, *, backward: bool | None = None) -> int:
    """Arrays passed through collective `op` (a combined tuple op counts each operand); with
    `backward`, only ops from the gradient (transpose) pass, or only the others."""
    total = 0
    for line in hlo.splitlines():
        match = re.search(rf"= .*? {op}(?:-start)?\((.*?)\)", line)
        if not match or (backward is not None and ("transpose(" in line) != backward):
            continue
        total += match.group(1).count("%")
    return total


def _compiled_group(cfg, grad: bool, loss=jnp.sum) -> str:
    mesh = make_mesh(cfg.parallel)
    groups_sharding = build_run(cfg, mesh).shardings["params"]["groups"]
    group_sharding = jax.tree.map(
        lambda s: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s.spec[1:])), groups_sharding
    )
    params = init_params(cfg)
    graph = nnx.graphdef(Model(cfg.model).bind(params).groups)
    group = jax.tree.map(lambda a: a[0], params["groups"])
    tokens = jnp.zeros((8, cfg.train.seq_len), jnp.int32)
    x = jnp.ones((8, cfg.train.seq_len, cfg.model.hidden))

    def run(group, x):
        x = constrain(x, *RESIDUAL)
        ctx = make_context(tokens, None, None, cfg.model.head_dim, cfg.model.rope_theta)
        return loss(nnx.merge(graph, group)(x, ctx))

    with jax.set_mesh(mesh), activation_rules(rules_for(cfg.parallel)):
        fn = jax.grad(run, argnums=(0, 1)) if grad else run
        return jax.jit(fn, in_shardings=(group_sharding, None)).lower(group, x).compile().as_text()


def test_tensor_parallel_forward_all_reduces_once_per_block():
    cfg = _tp_config()
    hlo = _compiled_group(cfg, grad=False)
    assert _count(hlo, "all-reduce") == 2 * cfg.model.qkv_share_every  # attention + feed-forward per layer
    assert _count(hlo, "all-gather") == 0
    assert _count(hlo, "reduce-scatter") == 0


def test_tensor_parallel_backward_all_reduces_once_per_block_and_gathers_no_weight():
    cfg = _tp_config()
    hlo = _compiled_group(cfg, grad=True)
    assert _count(hlo, "all-reduce", backward=True) == 2 * cfg.model.qkv_share_every
    assert _count(hlo, "all-reduce", backward=False) <= 2 * cfg.model.qkv_share_every
    assert _count(hlo, "all-gather") == 0


def _tp_config():
    cfg = small_config(qkv_share_every=2, num_kv_heads=8)
    cfg = cfg.updated(parallel=dict(tensor=8, data=1))
    return cfg


def test_sequence_parallel_blocks_reduce_scatter_and_all_gather_and_never_all_reduce_activations():
    """With sequence parallelism each block's input is all-gathered along the sequence and its
    output reduce-scattered back, in the forward pass and mirrored in the backward pass; no
    activation is all-reduced. (Squared outputs, so that no gradient is a constant XLA could fold.)"""
    cfg = _tp_config()
    cfg = cfg.updated(parallel=dict(sequence_parallel=True))
    blocks = 2 * cfg.model.qkv_share_every
    squares = lambda out: jnp.sum(out * out)  # noqa: E731
    forward, both = _compiled_group(cfg, grad=False, loss=squares), _compiled_group(cfg, grad=True, loss=squares)
    assert _count(forward, "all-gather") == blocks and _count(forward, "reduce-scatter") == blocks
    assert _count(both, "all-gather") == 2 * blocks and _count(both, "reduce-scatter") == 2 * blocks
    seq, hidden = cfg.train.seq_len, cfg.model.hidden
    activations = (f"[8,{seq // cfg.parallel.tensor},{hidden}]", f"[8,{seq},{hidden}]")
    for hlo in (forward, both):
        reduced = [line for line in hlo.splitlines() if re.search(r" all-reduce(-start)?\(", line)]
        assert not [line for line in reduced if any(shape in line for shape in activations)], reduced
