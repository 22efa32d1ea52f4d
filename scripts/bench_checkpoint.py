"""Checkpoint cost, single process: how long a save blocks the training loop against the time to
write it fully, and the restore time, for a model of a few hundred MB of random weights.

    python scripts/bench_checkpoint.py [--dir /tmp/jaxllm-bench-ckpt]
"""

from __future__ import annotations

import argparse
import shutil
import time

import jax

from jaxllm.config import RunConfig
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.run import build_run  # noqa: E402
from jaxllm.train.step import init_state  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default="/tmp/jaxllm-bench-ckpt")
    args = parser.parse_args()
    cfg = RunConfig().updated(
        model=dict(num_layers=8, hidden=1024, num_heads=16, mlp=2816, vocab_size=16000, dtype="float32"),
        parallel=dict(data=1),
    )
    mesh = make_mesh(cfg.parallel, jax.devices()[:1])
    shutil.rmtree(args.dir, ignore_errors=True)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = jax.block_until_ready(init_state(run))
        params = sum(x.nbytes for x in jax.tree.leaves(state["params"]))
        total = sum(x.nbytes for x in jax.tree.leaves(state))
        checkpoints = run.checkpointer(args.dir)
        start = time.perf_counter()
        checkpoints.save(1, state, {"next_index": 1})
        blocked = time.perf_counter() - start
        checkpoints.wait()
        written = time.perf_counter() - start
        checkpoints.close()
        start = time.perf_counter()
        restored = run.checkpointer(args.dir).restore_latest()
        jax.block_until_ready(restored.state)
        restore = time.perf_counter() - start
    print(f"state: {params / 1e6:.0f} MB of params, {total / 1e6:.0f} MB with Adam moments")
    print(f"save blocks the loop for  {blocked:7.2f} s")
    print(f"save written fully after  {written:7.2f} s  ({total / 1e6 / written:.0f} MB/s)")
    print(f"blocking / full write     {blocked / written:7.2f}")
    print(f"restore                   {restore:7.2f} s  ({total / 1e6 / restore:.0f} MB/s)")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
