"""Each pipeline schedule's measured bubble (the profiler's, as `train.profile_steps` logs it)
beside its analytic bubble and its step time, at 4 stages × 8 microbatches (`--microbatches` M,
a batch of 2M rows; 2 chunks for the chunked schedules), data 2, on the 8 devices JAX sees (fake
CPU devices unless there are 8 accelerators). For the zero-bubble schedules it also prints their
cells' measured costs and the table's bubble at those costs.

    python scripts/bench_bubble.py [--steps 3] [--plot docs/img] [--mlp 128] [--remat none]
        [--schedules 1f1b zero_bubble] [--microbatches 8] [--ynnpack]

With `--plot DIR` (the `plot` extra) it also draws each timetable-driven schedule's profiled step,
stage by stage (`pipeline-measured-<schedule>.svg`), the pictures beside the tables' on the
pipeline page, which are of 8 microbatches.

The model is tiny (8 layers of width 64): a stage's work is a few matmuls, and the head and the
loss cost about as much as a stage's forward of two layers. GPipe and circular run them after the
loop; the timetable-driven schedules inside it, each stage on its block of the vocabulary, in the
steps where the last stage forwards. On fake CPU devices, 8 share the host's cores. `--mlp` widens
the feed-forward, whose matmuls' input and weight gradients cost alike, so that they weigh more in
a stage's work than the attention's backward (no weights in it), as they do at scale.

On CPU it turns off XLA's YNNPACK dot fusions unless `--ynnpack` keeps them: with them, each
stage's first backward cell in every execution costs several times its later ones, a cost of the
CPU runtime that no table counts (docs/pipeline.md, "Measured bubbles", has the figures).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.config import CHUNKED_SCHEDULES, PIPELINE_SCHEDULES, REMAT_POLICIES, TABLE_SCHEDULES, RunConfig  # noqa: E402
from jaxllm.parallel import timetable  # noqa: E402
from jaxllm.parallel.mesh import make_mesh  # noqa: E402
from jaxllm.profile import StepProfiler  # noqa: E402
from jaxllm.profile.capture import stages_of  # noqa: E402
from jaxllm.train.run import build_run  # noqa: E402
from jaxllm.train.step import compile_train_step, init_state  # noqa: E402

# Every schedule, with 2 chunks per stage where it takes several: the fewest that interleave.
SCHEDULES = tuple((kind, 2 if kind in CHUNKED_SCHEDULES else 1) for kind in PIPELINE_SCHEDULES)


def profiled(schedule: str, chunks: int, steps: int, mlp: int, remat: str, microbatches: int):
    """(the profiler's summary of `steps` train steps after one that compiles, the run's schedule,
    the median time of as many steps after them, unprofiled)."""
    cfg = RunConfig().updated(
        model=dict(num_layers=8, hidden=64, num_heads=8, mlp=mlp, vocab_size=257, max_seq_len=64, qkv_share_every=1,
                   remat=remat, dtype="float32"),
        parallel=dict(data=2, stage=4, microbatches=microbatches, repeats=chunks, schedule=schedule),
        data=dict(bpe_vocab_size=256),
        train=dict(batch_size=2 * microbatches, seq_len=64),
    )  # fmt: skip
    mesh = make_mesh(cfg.parallel)
    tokens = np.random.default_rng(0).integers(0, 257, (2 * microbatches, 65)).astype(np.int32)
    with jax.set_mesh(mesh), tempfile.TemporaryDirectory() as logdir:
        run = build_run(cfg, mesh)
        state, step = init_state(run), compile_train_step(run)
        profiler = StepProfiler((2, 1 + steps), logdir, module="jit_train_step", schedule=run.schedule,
                                stage_of=stages_of(mesh), loop_steps=timetable.steps_of(run.schedule))  # fmt: skip
        batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, run.batch_sharding)
        for i in range(1, 2 + steps):
            profiler.before(i)
            state, metrics = step(state, batch)
            profiler.after(i, (state, metrics))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = jax.block_until_ready(step(state, batch))
            times.append(time.perf_counter() - start)
    return profiler.summary, run.schedule, float(np.median(times))


def _cells_alone(table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[steps, stages] masks of the cells that run only a forward, only a backward, only a weight
    pass (outside the steps with a share of the loss), and how many stages compute in each step."""
    forward, backward, weight = (a != timetable.IDLE for a in (table.forward, table.backward, table.weight))
    outside = ~table.loss_steps[:, None]
    busy = np.broadcast_to((forward | backward | weight).sum(axis=1, keepdims=True), forward.shape)
    only = (forward & ~backward & ~weight, backward & ~forward & ~weight, weight & ~forward & ~backward)
    return *(c & outside for c in only), busy


def cell_costs(table, work: np.ndarray) -> tuple[float, float, float]:
    """The median work of the cells that run only a forward, only a backward, only a weight pass."""
    return tuple(float(np.median(work[c])) for c in _cells_alone(table)[:3])


def forward_by_company(table, work: np.ndarray) -> dict[int, float]:
    """The median work of the cells that run only a forward, by how many stages compute in their
    step: on fake devices, which share the host's cores, more is slower."""
    forward, _, _, busy = _cells_alone(table)
    return {int(n): float(np.median(work[forward & (busy == n)])) for n in np.unique(busy[forward])}


def plot(directory: pathlib.Path, schedule, summary) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxllm.plan.plot import draw_measured_steps

    fig = plt.figure(figsize=(11, 2.8))
    draw_measured_steps(fig.subplots(), schedule, np.asarray(summary.stage_work), summary.bubble)
    fig.tight_layout()
    with matplotlib.rc_context({"svg.hashsalt": "jaxllm", "svg.fonttype": "none"}):
        fig.savefig(directory / f"pipeline-measured-{schedule.kind}.svg", format="svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="profiled train steps per schedule, then as many timed")
    parser.add_argument("--plot", type=pathlib.Path, help="draw each timetable-driven schedule's profiled step here")
    parser.add_argument("--mlp", type=int, default=128, help="the feed-forward's width (the model's: 64)")
    parser.add_argument("--remat", choices=REMAT_POLICIES, default="none", help="the model's remat policy")
    parser.add_argument("--schedules", nargs="+", choices=[s for s, _ in SCHEDULES], default=[s for s, _ in SCHEDULES])
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches a step (a row each per data replica)")
    parser.add_argument("--ynnpack", action="store_true", help="keep XLA:CPU's YNNPACK dot fusions on")
    args = parser.parse_args()
    if not args.ynnpack:  # read when JAX starts its backend, which the first jax.devices() does
        os.environ["XLA_FLAGS"] += " --xla_cpu_experimental_ynn_fusion_type="
    ynnpack = f", YNNPACK fusions {'on' if args.ynnpack else 'off'}" if jax.default_backend() == "cpu" else ""
    print(f"{jax.devices()[0].device_kind} × {jax.device_count()}, jax {jax.__version__}; 4 stages, "
          f"{args.microbatches} microbatches, mlp {args.mlp}, remat {args.remat}{ynnpack}")  # fmt: skip
    print(f"{'schedule':>23} {'chunks':>6} {'analytic':>9} {'measured':>9} {'step ms':>8}")
    analytic, measured, steps = {}, {}, {}
    for schedule, chunks in SCHEDULES:
        if schedule not in args.schedules:
            continue
        summary, run_schedule, steps[schedule] = profiled(
            schedule, chunks, args.steps, args.mlp, args.remat, args.microbatches
        )
        analytic[schedule], measured[schedule] = timetable.bubble_of(run_schedule), summary.bubble
        print(f"{schedule:>23} {chunks:>6} {analytic[schedule]:>9.3f} {measured[schedule]:>9.3f} "
              f"{steps[schedule] * 1e3:>8.1f}")  # fmt: skip
        if run_schedule.split:
            table, work = timetable.of(run_schedule), np.asarray(summary.stage_work) * 1e3
            f, b, w = cell_costs(table, work)
            print(f"{'':>25}cells: forward {f:.2f}, input gradient {b:.2f}, weight pass {w:.2f} ms; the table's "
                  f"bubble at these costs {table.bubble(timetable.Costs(f, b, w)):.3f}")  # fmt: skip
            by_busy = ", ".join(f"{n}: {ms:.2f}" for n, ms in forward_by_company(table, work).items())
            print(f"{'':>25}forward cells by the stages computing in their step: {by_busy} ms")
        if args.plot and summary.stage_work is not None:
            plot(args.plot, run_schedule, summary)
    if "1f1b" not in measured:
        return
    for kind in measured.keys() & set(TABLE_SCHEDULES) - {"1f1b"}:
        print(f"{kind} ÷ 1f1b: bubble measured {measured[kind] / measured['1f1b']:.2f}, analytic "
              f"{analytic[kind] / analytic['1f1b']:.2f}; step time {steps[kind] / steps['1f1b']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
