"""Training throughput of the tiny model against a minimal plain-JAX step, and compile time vs depth.

    python scripts/bench_train.py [--steps 20]

Everything runs side by side in this one process on one CPU device, so only ratios matter.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the independent plain-JAX reference model

from reference_model import reference_loss  # noqa: E402

from jaxllm import plan  # noqa: E402
from jaxllm.config import load_config  # noqa: E402
from jaxllm.parallel.mesh import make_mesh  # noqa: E402
from jaxllm.train.metrics import measure_matmul_peak  # noqa: E402
from jaxllm.train.optim import make_optimizer  # noqa: E402
from jaxllm.train.run import batch_sharding, build_run  # noqa: E402
from jaxllm.train.step import compile_train_step, init_state  # noqa: E402


def _batch(cfg, seed):
    t = cfg.train
    w = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1)).astype(np.int32)
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}


def _seconds_per_step(step, state, batches) -> float:
    state, metrics = step(state, batches[0])  # compile and warm up
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for b in batches[1:]:
        state, metrics = step(state, b)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / (len(batches) - 1)


def throughput(cfg, mesh, steps: int) -> tuple[float, float]:
    """(jaxllm s/step, plain-JAX s/step) for the same model, batch and optimizer."""
    batches = [jax.device_put(_batch(cfg, i), batch_sharding(mesh)) for i in range(steps + 1)]
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = init_state(run)
        params = jax.device_get(state["params"])  # before the donating step consumes them
        ours = _seconds_per_step(compile_train_step(run), state, batches)

        optimizer = make_optimizer(cfg.train)

        @jax.jit
        def plain_step(state, batch):
            params, opt_state = state
            loss, grads = jax.value_and_grad(reference_loss)(params, batch, cfg.model)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        plain = _seconds_per_step(plain_step, (params, optimizer.init(params)), batches)
    return ours, plain


def compile_seconds(cfg, mesh, groups: int) -> float:
    cfg = cfg.updated(model=dict(num_layers=groups * cfg.model.qkv_share_every))
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = run.state
        batch = jax.eval_shape(lambda: _batch(cfg, 0))
        start = time.perf_counter()
        compile_train_step(run).lower(state, batch).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    cfg = load_config(args.config)
    cfg = cfg.updated(parallel=dict(data=1))
    mesh = make_mesh(cfg.parallel, jax.devices()[:1])
    tokens = cfg.train.batch_size * cfg.train.seq_len
    flops = plan.flops_per_token(cfg.model, cfg.train.seq_len) * tokens

    peak = measure_matmul_peak()
    ours, plain = throughput(cfg, mesh, args.steps)
    print(f"CPU fp32 matmul peak           {peak / 1e9:10.1f} GFLOP/s")
    print(f"{'':30} {'tokens/s':>10} {'MFU':>8}")
    print(f"{'jaxllm train step':30} {tokens / ours:10.0f} {flops / ours / peak:8.1%}")
    print(f"{'plain-JAX step (same shapes)':30} {tokens / plain:10.0f} {flops / plain / peak:8.1%}")
    print(f"jaxllm / plain throughput      {plain / ours:10.2f}x")
    times = {g: compile_seconds(cfg, mesh, g) for g in (4, 32)}
    print(
        f"compile, scanned stack: 4 groups {times[4]:.2f} s, 32 groups {times[32]:.2f} s "
        f"(ratio {times[32] / times[4]:.2f} for 8x the depth)"
    )


if __name__ == "__main__":
    main()
