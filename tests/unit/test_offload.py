"""Host offload as the compiled program places it. The CPU backend has a pinned-host memory space
but one physical memory, so these tests show placement, not a saving: the optimizer state's
shardings and entry layout in host memory (`S(5)`), steps and checkpoints unchanged by it; the
'offload' remat policy's transfers of the named activations to host, in the program a GPU gets."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.runs import small_config

from jaxllm import plan
from jaxllm.config import ConfigError
from jaxllm.model import Model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.loop import offload_notes
from jaxllm.train.run import HOST, batch_sharding, build_run, check_host_memory
from jaxllm.train.step import compile_train_step, init_params, init_state, mean_loss


def _batch(cfg, seed):
    w = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


def _train(offload: bool, steps: int = 2):
    """`steps` real updates (lr > 0 from the first), each changing every parameter."""
    cfg = small_config()
    cfg = cfg.updated(parallel=dict(data=2, fsdp=2, tensor=2, offload_optimizer=offload))
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = init_state(run)
        batch = jax.device_put(_batch(cfg, 0), batch_sharding(mesh))
        compiled = compile_train_step(run).lower(state, batch).compile()
        losses = []
        for i in range(steps):
            before = jax.device_get(state["params"])
            state, metrics = compiled(state, jax.device_put(_batch(cfg, i), batch_sharding(mesh)))
            assert float(metrics["lr"]) > 0 and int(metrics["skipped"]) == 0
            moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), jax.device_get(state["params"]), before)
            assert all(jax.tree.leaves(moved)), moved
            losses.append(float(metrics["loss"]))
    return run, state, compiled, losses


def test_offloaded_optimizer_state_lives_in_host_memory_and_changes_nothing(tmp_path):
    """Every optimizer-state array is a pinned-host input and output of the compiled step (its
    entry layout puts each in memory space 5), params stay on device; after two real updates,
    losses, params and moments equal a run without offload bit for bit, leaf by leaf, and a
    checkpoint restores the state into host memory."""
    run, state, compiled, losses = _train(True)
    _, plain, _, plain_losses = _train(False)
    opt_leaves = jax.tree.leaves(state["opt_state"])
    out_state = compiled.output_shardings[0]
    assert {s.memory_kind for s in jax.tree.leaves(out_state["opt_state"])} == {HOST}
    assert {s.memory_kind for s in jax.tree.leaves(out_state["params"])} == {"device"}
    assert {a.sharding.memory_kind for a in opt_leaves} == {HOST}
    entry_layout = compiled.as_text().splitlines()[0]
    assert entry_layout.count(":S(5)}") == 2 * len(opt_leaves), entry_layout  # each in and out
    assert losses == plain_losses
    jax.tree.map(np.testing.assert_array_equal, state, plain)
    checkpoints = run.checkpointer(tmp_path)
    checkpoints.save(2, state, {})
    checkpoints.wait()
    restored = checkpoints.restore_latest().state
    checkpoints.close()
    assert {a.sharding.memory_kind for a in jax.tree.leaves(restored["opt_state"])} == {HOST}
    jax.tree.map(np.testing.assert_array_equal, restored["opt_state"], state["opt_state"])


def test_offload_remat_sends_the_named_activations_to_host():
    """Under remat 'offload' each layer sends to host the six named activations its backward
    reads (its input, q, k, v, the attention output, the GLU hidden; `mlp_out` only feeds an
    addition), and the backward brings each back: in the jaxpr and in the program lowered for a
    GPU. 'selective' keeps the same ones on device, with the same gradients."""
    batch = {"inputs": jnp.arange(32).reshape(2, 16) % 200, "targets": jnp.arange(1, 33).reshape(2, 16) % 200}
    params = init_params(small_config())
    grads, placements = {}, {}
    for remat in ("selective", "offload"):
        model = Model(small_config(remat=remat).model)
        grad = jax.jit(lambda p, m=model: jax.grad(mean_loss)(p, batch, m))
        grads[remat] = grad(params)
        gpu = grad.trace(params).lower(lowering_platforms=("cuda",)).as_text()
        placements[remat] = [gpu.count(f'_xla_buffer_placement = "{kind}"') for kind in (HOST, "device")]
    per_group = 6 * small_config().model.qkv_share_every  # the scan over groups has one body
    assert placements == {"selective": [0, 0], "offload": [per_group, per_group]}
    jax.tree.map(np.testing.assert_array_equal, grads["offload"], grads["selective"])


def test_start_up_says_what_offload_does_on_this_platform():
    cfg = small_config(remat="offload")
    cfg = cfg.updated(parallel=dict(offload_optimizer=True))
    cpu, gpu = offload_notes(cfg, "cpu"), offload_notes(cfg, "gpu")
    assert len(cpu) == len(gpu) == 2 and all("saves nothing here" in note for note in cpu)
    assert not any("saves nothing" in note for note in gpu)
    assert offload_notes(small_config(), "cpu") == []


def test_a_backend_without_pinned_host_memory_is_refused_by_name():
    class DeviceWithoutHostMemory:  # what such a backend's device reports
        platform = "other"

        def addressable_memories(self):
            return [SimpleNamespace(kind="device")]

    check_host_memory(jax.devices()[0])  # the CPU backend has it
    with pytest.raises(ConfigError, match=r"needs 'pinned_host' memory, .* \(other\) have \['device'\]; set parallel"):
        check_host_memory(DeviceWithoutHostMemory())


def test_the_planner_counts_offloaded_optimizer_state_apart_from_the_device():
    cfg = small_config()
    cfg = cfg.updated(parallel=dict(data=2, fsdp=2, tensor=2))
    on_device = plan.memory(cfg)
    cfg = cfg.updated(parallel=dict(offload_optimizer=True))
    offloaded = plan.memory(cfg)
    moments = on_device["optimizer state (Adam m, v)"]
    assert moments > 0 and offloaded["optimizer state (Adam m, v)"] == 0
    assert offloaded["optimizer state in host memory"] == moments
    assert offloaded["total"] == on_device["total"] - moments
