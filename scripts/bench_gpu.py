"""Train-step speed and memory on one GPU: MFU per remat policy, the compiler's memory estimate
against the device's measured peak, all side by side in one process.

    python scripts/bench_gpu.py [--config configs/1b.py] [--batch 8] [--seq 2048] [--steps 5]

MFU is model FLOPs (the planner's 6·applied params + attention) per step ÷ step time ÷ peak, for
two peaks: the datasheet's dense bf16 (the planner's accelerator table) and a bf16 8192³ matmul
measured here, the ceiling a real step can approach. Random tokens: no data pipeline in the way.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import plan
from jaxllm.config import load_config, validate
from jaxllm.parallel.mesh import make_mesh
from jaxllm.profile import StepProfiler
from jaxllm.train.metrics import measure_matmul_peak, peak_flops
from jaxllm.train.run import build_run  # noqa: E402
from jaxllm.train.step import compile_train_step, init_state  # noqa: E402


def run(cfg, steps: int, profile_dir: str | None = None) -> dict:
    """`steps` timed train steps of `cfg` on random tokens after two warm-up steps; with
    `profile_dir`, one more step traced there and its profile summary (or why there is none)."""
    mesh = make_mesh(cfg.parallel, jax.devices()[:1])
    t = cfg.train
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = init_state(run)
        batches = []
        for _ in range(steps + 3):
            w = rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1)).astype(np.int32)
            batches.append(jax.device_put({"inputs": w[:, :-1], "targets": w[:, 1:]}, run.batch_sharding))
        start = time.perf_counter()
        compiled = compile_train_step(run).lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - start
        mem = compiled.memory_analysis()
        for b in batches[:2]:  # warm-up
            state, metrics = compiled(state, b)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for b in batches[2:-1]:
            state, metrics = compiled(state, b)
        jax.block_until_ready((state, metrics))
        step_s = (time.perf_counter() - start) / steps
        summary = None
        if profile_dir is not None:
            profiler = StepProfiler((0, 0), profile_dir)
            try:
                profiler.before(0)
                state, metrics = compiled(state, batches[-1])
                summary = profiler.after(0, (state, metrics))
            except Exception as error:  # a trace that cannot be read loses the profile, not the step's figures
                profiler.close()
                summary = error
    stats = jax.devices()[0].memory_stats() or {}  # the state's buffers are still alive here
    return {
        "compile_s": compile_s,
        "step_s": step_s,
        "loss": float(metrics["loss"]),
        "compiled_gib": (mem.argument_size_in_bytes + mem.temp_size_in_bytes) / 2**30,
        "measured_peak_gib": stats.get("peak_bytes_in_use", float("nan")) / 2**30,
        "resident_gib": stats.get("bytes_in_use", float("nan")) / 2**30,
        "hlo": compiled.as_text(),
        "profile": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/1b.py")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    # least memory first: the device's peak is the process's so far
    parser.add_argument("--remat", nargs="+", default=["full", "selective", "dots"])
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("bench_gpu.py measures a GPU; this machine has none")
    cfg = load_config(args.config)
    cfg = cfg.updated(
        parallel=dict(data=1, fsdp=1, stage=1, tensor=1),
        train=dict(batch_size=args.batch, seq_len=args.seq, grad_accum_steps=1),
    )
    validate(cfg, 1)
    datasheet, source = peak_flops(jax.devices()[:1])
    measured = measure_matmul_peak(8192, dtype=jnp.bfloat16)
    flops = plan.flops_per_token(cfg.model, args.seq) * args.batch * args.seq
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; {args.config}: "
          f"{plan.param_counts(cfg.model)['total'] / 1e9:.2f}B params, batch {args.batch} × {args.seq}")  # fmt: skip
    print(f"peak bf16: datasheet {datasheet / 1e12:.0f} TFLOP/s ({source}), 8192³ matmul here {measured / 1e12:.0f}")
    print(f"{'remat':>10} {'compile s':>10} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'of matmul':>10} "
          f"{'compiled GiB':>13} {'measured GiB':>13}")  # fmt: skip
    for remat in args.remat:
        cfg = cfg.updated(model=dict(remat=remat))
        r = run(cfg, args.steps)
        print(f"{remat:>10} {r['compile_s']:10.1f} {r['step_s']:8.3f} {args.batch * args.seq / r['step_s']:10.0f} "
              f"{flops / r['step_s'] / datasheet:6.1%} {flops / r['step_s'] / measured:10.1%} "
              f"{r['compiled_gib']:13.1f} {r['measured_peak_gib']:13.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
