"""The test suite's quick compile flags (tests/support/xla_flags.py) against XLA's defaults, side by
side in one run: seconds to compile the small test config's train step on 8 fake CPU devices
(data 2 × fsdp 2 × tensor 2), and seconds a step after, each in a fresh process with no
compilation cache, the two flag sets taking turns.

    python scripts/bench_compile_flags.py [--repeats 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.xla_flags import xla_flags  # noqa: E402

FLAG_SETS = {"default": xla_flags(8, quick=False), "quick": xla_flags(8)}


def measure(steps: int) -> dict[str, float]:
    """In this process: the train step's compile seconds and its seconds a step."""
    import jax
    import numpy as np
    from support.runs import small_config

    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.train.run import batch_sharding, build_run
    from jaxllm.train.step import compile_train_step, init_state

    cfg = small_config().updated(parallel=dict(data=2, fsdp=2, tensor=2))
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = init_state(run)
        shape = (cfg.train.batch_size, cfg.train.seq_len + 1)
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, shape)
        batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, batch_sharding(mesh))
        start = time.perf_counter()
        step = compile_train_step(run).lower(state, batch).compile()
        compiled = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        ran = time.perf_counter()
        for _ in range(steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        return {"compile_s": compiled - start, "step_s": (time.perf_counter() - ran) / steps}


def in_fresh_process(flags: str, steps: int) -> dict[str, float]:
    env = {**os.environ, "XLA_FLAGS": flags}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps)], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps)))
        return
    runs = {name: [] for name in FLAG_SETS}
    for _ in range(args.repeats):
        for name, flags in FLAG_SETS.items():
            runs[name].append(in_fresh_process(flags, args.steps))
    best = {name: {key: min(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    print(f"{'flags':<9}{'compile s':>11}{'step ms':>10}   (best of {args.repeats})")
    for name, b in best.items():
        print(f"{name:<9}{b['compile_s']:>11.2f}{b['step_s'] * 1e3:>10.1f}   {FLAG_SETS[name]}")
    d, q = best["default"], best["quick"]
    print(f"quick / default: compile {q['compile_s'] / d['compile_s']:.2f}×, step {q['step_s'] / d['step_s']:.2f}×")


if __name__ == "__main__":
    main()
