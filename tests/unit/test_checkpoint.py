"""Checkpoints: restore onto other layouts and meshes, roll back, corrupt and incompatible checkpoints,
retention, saves by time, checksums."""

import shutil
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.faults import alter_one_value, corrupt_arrays
from support.runs import checkpoint_params, small_config

from jaxllm.checkpoint import Checkpointer, CheckpointError, load_params
from jaxllm.config import ConfigError
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.loop import roll_back
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_train_step, init_state


def _batch(cfg, i):
    w = np.random.default_rng(i).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


def _config(**parallel):
    cfg = small_config(num_layers=8, qkv_share_every=2)  # 4 groups
    cfg = cfg.updated(parallel=parallel)
    return cfg


def _steps(cfg, mesh, state, first, count):
    losses = []
    step = compile_train_step(build_run(cfg, mesh))
    for i in range(first, first + count):
        state, metrics = step(state, jax.device_put(_batch(cfg, i), batch_sharding(mesh)))
        losses.append(float(metrics["loss"]))
    return state, losses


LAYOUTS = {
    "fsdp4 tensor2": dict(fsdp=4, tensor=2),
    "one device": dict(data=1),
    "pipeline S2 R2 data4": dict(stage=2, microbatches=2, repeats=2, data=4, schedule="circular"),
    "pipeline S4 R1 data2": dict(stage=4, microbatches=4, data=2),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """3 steps on data2×tensor4, a checkpoint, then 2 more steps as the reference."""
    workdir = tmp_path_factory.mktemp("ckpt")
    cfg = _config(data=2, tensor=4)
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        state, _ = _steps(cfg, mesh, init_state(build_run(cfg, mesh)), 0, 3)
        checkpoints = build_run(cfg, mesh).checkpointer(workdir)
        checkpoints.save(3, state, {"next_index": 3})
        checkpoints.close()
        _, after = _steps(cfg, mesh, state, 3, 2)
    return workdir, after


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_restore_onto_another_layout_continues_the_same(saved, layout):
    workdir, after = saved
    cfg = _config(**layout)
    devices = jax.devices()[:1] if layout == {"data": 1} else jax.devices()
    mesh = make_mesh(cfg.parallel, devices)
    with jax.set_mesh(mesh):
        restored = build_run(cfg, mesh).checkpointer(workdir).restore_latest()
        assert restored.step == 3 and restored.data_state == {"next_index": 3}
        _, losses = _steps(cfg, mesh, restored.state, 3, 2)
    np.testing.assert_allclose(losses, after, rtol=1e-5)


@pytest.mark.parametrize(
    "layout",
    [dict(stage=4, microbatches=4, data=2), dict(stage=2, microbatches=2, repeats=2, data=4, schedule="circular")],
)
def test_pipelined_restore_target_takes_the_training_states_bytes_per_device(layout):
    """The canonical state a pipelined run reads into is split over `stage` like the run's own,
    never replicated over it (for 120B that would be ~83 GiB per device before the reshape)."""
    cfg = _config(**layout)
    run = build_run(cfg, make_mesh(cfg.parallel))

    def per_device(shapes, shardings):
        leaves = zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True)
        return sum(np.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize for s, sh in leaves)

    training = jax.eval_shape(lambda: init_state(run))
    assert per_device(run.canonical, jax.tree.map(lambda s: s.sharding, run.canonical)) == per_device(
        training, run.shardings
    )


def test_params_only_restore_onto_another_mesh_in_another_dtype(saved):
    workdir, _ = saved  # saved on data2×tensor4, in fp32
    mesh = make_mesh(_config(fsdp=4, tensor=2).parallel)
    cfg, params, step = load_params(workdir, mesh, dtype="bfloat16")
    assert step == 3 and cfg.parallel.tensor == 4 and "opt_state" not in params
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
    assert params["groups"]["layers"]["mlp"]["down"].sharding.spec == P(None, None, "tensor", "fsdp")
    want = jax.tree.map(lambda a: a.astype(jnp.bfloat16), checkpoint_params(workdir, 3))
    chex.assert_trees_all_equal(jax.device_get(params), want)


def test_roll_back_reads_the_checkpoint_before_the_streak_and_frees_the_state(tmp_path):
    """A bad streak that began at step 3: the checkpoint at 4 (saved during it) is passed over
    for the one at 2, and the current state is freed before that one is read."""
    cfg = _config(data=8)
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        checkpoints = run.checkpointer(tmp_path)
        state, _ = _steps(cfg, mesh, init_state(run), 0, 2)
        checkpoints.save(2, state, {})
        want = jax.device_get(state["params"])
        state, _ = _steps(cfg, mesh, state, 2, 2)
        checkpoints.save(4, state, {})
        checkpoints.wait()
        back, step = roll_back(checkpoints, state, before=3)
        checkpoints.close()
    assert step == 2 and int(back["step"]) == 4  # the step counter goes on
    chex.assert_trees_all_equal(jax.device_get(back["params"]), want)
    assert all(a.is_deleted() for a in jax.tree.leaves(state["params"]))


def test_pipeline_checkpoint_restores_without_pipeline(tmp_path):
    pipelined, plain = _config(stage=2, microbatches=2, data=4), _config(data=8)
    mesh = make_mesh(pipelined.parallel)
    with jax.set_mesh(mesh):
        state, _ = _steps(pipelined, mesh, init_state(build_run(pipelined, mesh)), 0, 2)
        checkpoints = build_run(pipelined, mesh).checkpointer(tmp_path)
        checkpoints.save(2, state, {})
        checkpoints.close()
        _, want = _steps(pipelined, mesh, state, 2, 2)
    mesh = make_mesh(plain.parallel)
    with jax.set_mesh(mesh):
        restored = build_run(plain, mesh).checkpointer(tmp_path).restore_latest()
        _, got = _steps(plain, mesh, restored.state, 2, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_corrupt_latest_checkpoint_is_reported_moved_aside_and_passed_over(tmp_path, capsys):
    cfg = _config(data=8)
    mesh = make_mesh(cfg.parallel)
    directory = tmp_path / "checkpoints"
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = init_state(run)
        checkpoints = run.checkpointer(tmp_path)
        checkpoints.save(2, state, {"next_index": 2})
        checkpoints.save(4, state, {"next_index": 4})
        checkpoints.close()
        corrupt_arrays(directory / "4")
        restored = run.checkpointer(tmp_path).restore_latest()
        assert restored.step == 2
        report = [line for line in capsys.readouterr().out.splitlines() if "step 4 is unreadable" in line]
        assert len(report) == 1 and len(report[0]) < 400, report  # one line, not a TensorStore dump
        assert (directory / "4.unreadable").is_dir() and not (directory / "4").exists()  # renamed, never deleted

        corrupt_arrays(directory / "2")  # none readable: refused, and nothing is moved
        with pytest.raises(CheckpointError, match=r"none of the checkpoints \[2\]"):
            run.checkpointer(tmp_path).restore_latest()
        assert (directory / "2").is_dir()


def test_incompatible_model_is_a_clear_error(saved):
    workdir, _ = saved
    cfg = _config(data=8)
    cfg = cfg.updated(model=dict(hidden=128))
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match=r"another model shape .*'hidden': \(64, 128\)"):
        build_run(cfg, mesh).checkpointer(workdir).restore_latest()


def test_explicit_defaults_are_the_same_model_shape(saved):
    workdir, _ = saved
    cfg = _config(data=8)
    cfg = cfg.updated(model=dict(head_dim=cfg.model.hidden // cfg.model.num_heads))  # saved as None: the same size
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        assert build_run(cfg, mesh).checkpointer(workdir).restore_latest().step == 3


@pytest.fixture(scope="module")
def plain():
    """A data-parallel run and its initial state, for tests that only save and restore."""
    cfg = _config(data=8)
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        return run, init_state(run)


def _checkpointer(run, workdir, clock=time.monotonic, **checkpoint):
    cfg = run.cfg.updated(checkpoint=checkpoint)
    return Checkpointer(workdir, cfg, run.mesh, run.canonical, run.shardings, clock=clock)


def _on_disk(workdir) -> list[int]:
    """The steps saved in `workdir` (not those moved aside)."""
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.parametrize("every_steps,keep,keep_every", [(1, 3, 4), (2, 2, 0)])
def test_retention_keeps_the_last_k_and_every_mth_step(tmp_path, plain, every_steps, keep, keep_every):
    run, state = plain
    steps = 12
    with jax.set_mesh(run.mesh):
        checkpoints = _checkpointer(run, tmp_path, every_steps=every_steps, keep=keep, keep_every=keep_every)
        for step in range(1, steps + 1):
            if checkpoints.due(step):
                checkpoints.save(step, state, {})
        checkpoints.close()
    saved = list(range(every_steps, steps + 1, every_steps))
    for_good = {s for s in saved if keep_every and s % keep_every == 0}
    assert _on_disk(tmp_path) == sorted(set(saved[-keep:]) | for_good)


def test_saves_by_time_once_the_minutes_have_passed(tmp_path, plain):
    run, state = plain
    now = 0.0
    with jax.set_mesh(run.mesh):
        checkpoints = _checkpointer(run, tmp_path, lambda: now, every_steps=0, every_minutes=2, keep=10)
        untimed = _checkpointer(run, tmp_path / "untimed", lambda: now, every_steps=0, every_minutes=0)
        due, never = [], []
        # The clock after each step, in seconds: 10, 210*, 240, 270, 300, 330*, 335, 340, 640*, 641;
        # * marks 120 s or more since the last save (or the start).
        for step, seconds in enumerate([10, 200, 30, 30, 30, 30, 5, 5, 300, 1], start=1):
            now += seconds
            if checkpoints.due(step):
                checkpoints.save(step, state, {})
                due.append(step)
            never += [step] if untimed.due(step) else []
        checkpoints.close()
        untimed.close()
    assert due == [2, 6, 9] and never == []
    assert _on_disk(tmp_path) == [2, 6, 9]


@pytest.fixture(scope="module")
def two_steps(plain, tmp_path_factory):
    """A workdir with checkpoints at steps 2 and 4 (different data positions), to copy and damage."""
    run, state = plain
    workdir = tmp_path_factory.mktemp("two")
    with jax.set_mesh(run.mesh):
        checkpoints = run.checkpointer(workdir)
        checkpoints.save(2, state, {"next_index": 2})
        checkpoints.save(4, state, {"next_index": 4})
        checkpoints.close()
    return workdir


def _restore_passes_over_step_4(run, workdir, capsys, why: str):
    """Restores step 2, having reported step 4 in one line (with `why`) and moved it aside."""
    with jax.set_mesh(run.mesh):
        checkpoints = run.checkpointer(workdir)
        restored = checkpoints.restore_latest()
        checkpoints.close()
    assert restored.step == 2 and restored.data_state == {"next_index": 2}
    report = [line for line in capsys.readouterr().out.splitlines() if "step 4 is unreadable" in line]
    assert len(report) == 1 and len(report[0]) < 400 and why in report[0], report
    assert (workdir / "checkpoints" / "4.unreadable").is_dir() and _on_disk(workdir) == [2]


# Our metadata item, the data position, Orbax's tree and array metadata: each a JSON file.
METADATA = ["meta/metadata", "data/metadata", "state/_METADATA", "state/array_metadatas/process_0"]


@pytest.mark.parametrize("damage", ["truncated", "not JSON"])
@pytest.mark.parametrize("name", METADATA)
def test_corrupt_metadata_is_reported_moved_aside_and_passed_over(tmp_path, plain, two_steps, capsys, name, damage):
    shutil.copytree(two_steps, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "checkpoints" / "4" / name
    text = path.read_text()
    path.write_text(text[: len(text) // 2] if damage == "truncated" else "<html>Not Found</html>")
    _restore_passes_over_step_4(plain[0], tmp_path, capsys, "JSONDecodeError")


def test_orbax_step_metadata_is_not_needed_to_restore(tmp_path, plain, two_steps, capsys):
    """`_CHECKPOINT_METADATA` holds only Orbax's timestamps: damaged, the step still restores whole."""
    run, _ = plain
    shutil.copytree(two_steps, tmp_path, dirs_exist_ok=True)
    (tmp_path / "checkpoints" / "4" / "_CHECKPOINT_METADATA").write_text("{")
    with jax.set_mesh(run.mesh):
        checkpoints = run.checkpointer(tmp_path)
        assert checkpoints.restore_latest().step == 4
        checkpoints.close()
    assert "unreadable" not in capsys.readouterr().out


def test_silently_changed_arrays_fail_their_checksum(tmp_path, plain, two_steps, capsys):
    """One number changed in files that still decode: the params-only restore and the run's own
    both pass over that step."""
    shutil.copytree(two_steps, tmp_path, dirs_exist_ok=True)
    alter_one_value(tmp_path / "checkpoints" / "4")
    assert not np.array_equal(checkpoint_params(tmp_path, 4)["embed"], checkpoint_params(tmp_path, 2)["embed"])
    assert load_params(tmp_path)[2] == 2
    assert "step 4 of" in capsys.readouterr().out
    _restore_passes_over_step_4(plain[0], tmp_path, capsys, "checksum mismatch: ['params']['embed']")
