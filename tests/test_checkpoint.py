"""Checkpoints: restore onto other layouts, bit-exact resume after SIGKILL, corrupt and
incompatible checkpoints, preemption, non-finite steps."""

import signal
import subprocess

import chex
import jax
import numpy as np
import pytest
from conftest import checkpoint_params, metrics, run, small_config, start_until_first_step, train_command

from jaxllm.config import ConfigError
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.checkpoint import Checkpointer
from jaxllm.train.step import batch_sharding, compile_train_step, init_state


def _batch(cfg, i):
    w = np.random.default_rng(i).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


def _config(**parallel):
    cfg = small_config(num_layers=8, qkv_share_every=2)  # 4 groups
    cfg.parallel.update(parallel)
    return cfg


def _steps(cfg, mesh, state, first, count):
    losses = []
    step = compile_train_step(cfg, mesh)
    for i in range(first, first + count):
        state, metrics = step(state, jax.device_put(_batch(cfg, i), batch_sharding(mesh)))
        losses.append(float(metrics["loss"]))
    return state, losses


LAYOUTS = {
    "fsdp4 tensor2": dict(fsdp=4, tensor=2),
    "one device": dict(data=1),
    "pipeline S2 data4": dict(stage=2, microbatches=2, data=4),
    "pipeline S4 R1 data2": dict(stage=4, microbatches=4, data=2),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """3 steps on data2×tensor4, a checkpoint, then 2 more steps as the reference."""
    workdir = tmp_path_factory.mktemp("ckpt")
    cfg = _config(data=2, tensor=4)
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        state, _ = _steps(cfg, mesh, init_state(cfg, mesh), 0, 3)
        checkpoints = Checkpointer(workdir, cfg, mesh)
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
        restored = Checkpointer(workdir, cfg, mesh).restore_latest()
        assert restored.step == 3 and restored.data_state == {"next_index": 3}
        _, losses = _steps(cfg, mesh, restored.state, 3, 2)
    np.testing.assert_allclose(losses, after, rtol=1e-5)


def test_pipeline_checkpoint_restores_without_pipeline(tmp_path):
    pipelined, plain = _config(stage=2, microbatches=2, data=4), _config(data=8)
    mesh = make_mesh(pipelined.parallel)
    with jax.set_mesh(mesh):
        state, _ = _steps(pipelined, mesh, init_state(pipelined, mesh), 0, 2)
        checkpoints = Checkpointer(tmp_path, pipelined, mesh)
        checkpoints.save(2, state, {})
        checkpoints.close()
        _, want = _steps(pipelined, mesh, state, 2, 2)
    mesh = make_mesh(plain.parallel)
    with jax.set_mesh(mesh):
        restored = Checkpointer(tmp_path, plain, mesh).restore_latest()
        _, got = _steps(plain, mesh, restored.state, 2, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_corrupt_latest_checkpoint_is_reported_and_passed_over(tmp_path, capsys):
    cfg = _config(data=8)
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        state = init_state(cfg, mesh)
        checkpoints = Checkpointer(tmp_path, cfg, mesh)
        checkpoints.save(2, state, {"next_index": 2})
        checkpoints.save(4, state, {"next_index": 4})
        checkpoints.close()
        for f in (tmp_path / "checkpoints" / "4" / "state").rglob("*"):
            if f.is_file() and f.stat().st_size > 1000:
                f.write_bytes(b"\0" * 16)  # an unreadable array
        restored = Checkpointer(tmp_path, cfg, mesh).restore_latest()
    assert restored.step == 2
    assert "checkpoint: step 4 is unreadable" in capsys.readouterr().out


def test_incompatible_model_is_a_clear_error(saved):
    workdir, _ = saved
    cfg = _config(data=8)
    cfg.model.hidden = 128
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match=r"another model shape .*'hidden': \(64, 128\)"):
        Checkpointer(workdir, cfg, mesh).restore_latest()


def _cli(workdir, *overrides, check=True):
    return run(
        train_command(workdir, "--config.checkpoint.every_steps=4", "--config.parallel.data=8", *overrides), check=check
    )


def _losses(workdir):
    return [(m["step"], m["loss"]) for m in metrics(workdir)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cli") / "full"
    _cli(workdir)
    return workdir


KILLS = {
    "before the first checkpoint": ["--config.debug.kill_at_step=3"],
    "between checkpoints": ["--config.debug.kill_at_step=6"],
    "during an async save": ["--config.debug.kill_at_step=8", "--config.debug.kill_during_save=True"],
}


@pytest.mark.parametrize("kill", KILLS.values(), ids=KILLS.keys())
def test_sigkill_and_resume_is_bit_identical(uninterrupted, kill):
    workdir = uninterrupted.parent / ("killed" + kill[0].split("=")[-1])
    proc = _cli(workdir, *kill, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    resumed = _cli(workdir)
    assert ("checkpoint: restored step" in resumed.stdout) == (kill != KILLS["before the first checkpoint"])
    assert _losses(workdir) == _losses(uninterrupted)  # bit-identical, and cut back to one clean run
    chex.assert_trees_all_equal(checkpoint_params(workdir, 12), checkpoint_params(uninterrupted, 12))


def test_sigterm_saves_and_exits_cleanly(uninterrupted):
    workdir = uninterrupted.parent / "preempted"
    command = train_command(workdir, "--config.train.steps=400", "--config.checkpoint.every_steps=1000")
    proc = start_until_first_step(command, workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    step = int(out.split("preempted: checkpoint saved at step ")[1].split(";")[0])
    assert (workdir / "checkpoints" / str(step)).is_dir()
    resumed = _cli(workdir, f"--config.train.steps={step + 2}")
    assert f"checkpoint: restored step {step}" in resumed.stdout
    assert _losses(workdir)[-1][0] == step + 2


def test_non_finite_steps_are_skipped_then_rolled_back(uninterrupted):
    workdir = uninterrupted.parent / "nan"
    proc = _cli(workdir, "--config.debug.nan_at_steps=(3,6,7)", "--config.checkpoint.max_bad_steps=2")
    out = proc.stdout
    assert "step 3: non-finite loss or gradients, update skipped (1 in a row)" in out
    assert "step 7: back to the params of step 4; the batches since are skipped" in out
    last = metrics(workdir)[-1]
    assert last["step"] == 12 and last["skipped_total"] == 3 and np.isfinite(last["loss"])
