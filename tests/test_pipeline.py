"""The pipeline against a plain sequential loop over the same weights, its collectives, and its
training losses against the same run without it."""

import os
import re
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
from conftest import ROOT, metrics, run, small_config, train_command
from reference_model import reference_loss

from jaxllm import plan
from jaxllm.config import load_config
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.schedule import canonical_view, schedule_of
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_train_step, init_state, mean_loss

# (stages, microbatches, repeats, other mesh axes[, remat]): covers M ∈ {S, 2S}, R ∈ {1, 2}, S ∈ {2, 4}
# and the combined layouts.
CASES = {
    "S2 M2 R1 data4": (2, 2, 1, dict(data=4)),
    "S2 M4 R2 data4": (2, 4, 2, dict(data=4)),
    "S4 M4 R1 data2": (4, 4, 1, dict(data=2)),
    "S4 M8 R2 data2": (4, 8, 2, dict(data=2)),
    "S2 M4 R1 tensor2 data2": (2, 4, 1, dict(tensor=2, data=2)),
    "S2 M2 R2 fsdp2 tensor2": (2, 2, 2, dict(fsdp=2, tensor=2, data=1)),
    "S4 M4 R2 data2 remat full": (4, 4, 2, dict(data=2), "full"),
}


def _config(stages, microbatches, repeats, axes, **model):
    cfg = small_config(num_layers=16, qkv_share_every=2, **model)  # 8 groups
    cfg.parallel.update(stage=stages, microbatches=microbatches, repeats=repeats, **axes)
    return cfg


def _batch(cfg):
    w = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_pipeline_matches_sequential_loop(case):
    stages, microbatches, repeats, axes, *remat = case
    cfg = _config(stages, microbatches, repeats, axes, remat=remat[0] if remat else "none")
    mesh = make_mesh(cfg.parallel)
    batch = _batch(cfg)
    with jax.set_mesh(mesh):
        state = init_state(build_run(cfg, mesh))
        loss_fn = jax.jit(jax.value_and_grad(lambda p, b: mean_loss(p, b, cfg.model, schedule_of(cfg))))
        loss, grads = loss_fn(state["params"], jax.device_put(batch, batch_sharding(mesh)))
    params, grads = jax.device_get((state["params"], grads))
    params["groups"], grads["groups"] = canonical_view(params["groups"]), canonical_view(grads["groups"])
    want_loss, want_grads = jax.value_and_grad(reference_loss)(params, batch, cfg.model)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-3, atol=1e-6)


def _while_bodies(hlo: str) -> set[str]:
    """Names of every computation run inside a while loop (bodies and what they call)."""
    comps = dict(re.findall(r"^(?:ENTRY )?%(\S+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M))
    inside, todo = set(), [b for c in comps.values() for b in re.findall(r"body=%([\w.\-]+)", c)]
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo += re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%([\w.\-]+)", comps[name])
    return {name: comps[name] for name in inside}


def test_pipeline_shifts_by_collective_permute_and_gathers_weights_before_the_loop():
    cfg = _config(2, 4, 1, dict(fsdp=2, tensor=2, data=1))
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        params = jax.eval_shape(lambda: init_state(build_run(cfg, mesh)))["params"]
        grad_fn = jax.jit(
            jax.grad(lambda p, b: mean_loss(p, b, cfg.model, schedule_of(cfg))),
            in_shardings=(build_run(cfg, mesh).shardings["params"], batch_sharding(mesh)),
        )
        hlo = grad_fn.lower(params, _batch(cfg)).compile().as_text()
    loops = _while_bodies(hlo)
    assert loops, "the pipeline should compile to a while loop"
    in_loops = "\n".join(loops.values())
    assert "collective-permute" in in_loops, "stage shifts should be collective-permutes inside the loop"
    assert "all-gather" not in in_loops, "FSDP weights must be gathered once, before the loop"
    assert "all-gather" in hlo, "the FSDP gather should happen (outside the loop)"


BF16_LAYOUTS = {
    "data2 tensor4": dict(data=2, tensor=4),
    "S2 M2 fsdp2 tensor2": dict(stage=2, microbatches=2, fsdp=2, tensor=2, data=1),
}


@pytest.mark.parametrize("layout", BF16_LAYOUTS.values(), ids=BF16_LAYOUTS.keys())
def test_bf16_compute_trains_like_fp32(layout):
    """bf16 compute through the tensor-parallel and pipeline collectives compiles and stays within
    bf16 rounding of the fp32 run."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        cfg = small_config(num_layers=8, qkv_share_every=2, dtype=dtype)
        cfg.parallel.update(layout)
        mesh = make_mesh(cfg.parallel)
        with jax.set_mesh(mesh):
            state = init_state(build_run(cfg, mesh))
            step = compile_train_step(build_run(cfg, mesh))
            batch = jax.device_put(_batch(cfg), batch_sharding(mesh))
            losses[dtype] = [float(loss) for loss in _losses(step, state, batch, 2)]
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=2e-2)


def _losses(step, state, batch, n):
    for _ in range(n):
        state, metrics = step(state, batch)
        yield metrics["loss"]


def test_120b_dry_run_compiles_reduced_depth():
    """The 120B layout (tensor 8 × stage 4 × fsdp 2 on 64 fake devices), 16 layers instead of 80."""
    cmd = [
        sys.executable,
        "-m",
        "jaxllm.train",
        "--config",
        "configs/120b.py",
        "--dry-run",
        "--config.model.num_layers=16",
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "mesh: data 1 × fsdp 2 × stage 4 × tensor 8 = 64 cpu devices" in out
    assert "bubble 8.6%" in out
    temporaries = float(re.search(r"temporaries\s+([\d.]+) GiB", out).group(1))
    arguments = float(re.search(r"arguments\s+([\d.]+) GiB", out).group(1))
    # fp32 params + Adam moments = 12 bytes each: layers split 64 ways, the embedding and head 16
    # ways (tensor × fsdp; every stage holds them), plus a negligible batch
    cfg = load_config("configs/120b.py")
    cfg.model.num_layers = 16
    counts = plan.param_counts(cfg.model)
    head = counts["embedding"] + counts["lm_head"]
    want = ((counts["total"] - head) * 12 / 64 + head * 12 / 16) / 2**30
    assert abs(arguments - want) < 0.02, (arguments, want)
    assert 0 < temporaries < 80


def test_pipeline_training_losses_match_no_pipeline(tmp_path):
    """The CLI's metrics.jsonl losses with a pipeline equal those without it."""
    layouts = {
        "plain": ["--config.parallel.data=8"],
        "pipeline": ["--config.parallel.data=2", "--config.parallel.stage=4", "--config.parallel.microbatches=4"],
    }
    runs = {}
    for name, layout in layouts.items():
        shape = ["--config.model.num_layers=8", "--config.model.qkv_share_every=2", "--config.train.log_every=4",
                 "--config.data.eval_every=4"]  # fmt: skip
        run(train_command(tmp_path / name, *shape, *layout))
        runs[name] = metrics(tmp_path / name)
    assert [m["step"] for m in runs["pipeline"]] == [4, 8, 12]
    np.testing.assert_allclose([m["loss"] for m in runs["pipeline"]], [m["loss"] for m in runs["plain"]], rtol=1e-5)
    assert all(m["bubble"] == pytest.approx(3 / 7) for m in runs["pipeline"])
