"""The attention implementations on one GPU, side by side: each against `xla` (output and gradients
in bf16, packed documents, as norm-relative differences), and forward + backward time as a ratio to
`xla`. `scripts/gpu_check.py` judges the same figures (`compare`).

    python scripts/bench_attention.py [--batch 2] [--seq 4096] [--heads 16] [--kv-heads 16] [--head-dim 128]

`pallas` runs only with as many kv heads as query heads (no GQA); with fewer it is skipped.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model import layers


def timed(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def compare(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, dict[str, float]]:
    """Each implementation this backend runs against `xla`, in bf16 over packed documents: forward +
    backward seconds, and the norm-relative difference of the output and of the gradients."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim), jnp.bfloat16) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    # Two documents per row, split at different points, so masking across them would show.
    split = jnp.arange(seq)[None, :] >= (jnp.arange(1, batch + 1) * seq // (batch + 2))[:, None]
    segment_ids = split.astype(jnp.int32) + 1

    def step(implementation, q, k, v):
        attend = partial(layers.self_attention, segment_ids=segment_ids, implementation=implementation)
        out, backward = jax.vjp(lambda q, k, v: attend(q, k, v), q, k, v)
        return out, backward(cotangent)

    fused = ["cudnn"] + (["pallas"] if kv_heads == heads else []) if jax.default_backend() == "gpu" else []
    results = {impl: jax.jit(partial(step, impl)) for impl in ["xla", *fused]}
    reference = jax.tree.map(lambda a: np.asarray(a, np.float32), results["xla"](q, k, v))

    def relative(got, want):
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    rows = {}
    for impl, fn in results.items():
        got = jax.tree.map(lambda a: np.asarray(a, np.float32), fn(q, k, v))
        rows[impl] = {
            "seconds": timed(fn, q, k, v),
            "output": relative(got[0], reference[0]),
            "gradients": max(relative(g, r) for g, r in zip(got[1], reference[1], strict=True)),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("bench_attention.py measures a GPU; this machine has none")
    rows = compare(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim)
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; batch {args.batch}, seq {args.seq}, heads "
          f"{args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, bf16, packed documents")  # fmt: skip
    print(f"{'attention':>10} {'fwd+bwd ms':>11} {'vs xla':>7} {'Δ out':>9} {'Δ grads':>9}   (Δ: norm-relative to xla)")
    base = rows["xla"]["seconds"]
    for impl, r in rows.items():
        print(f"{impl:>10} {r['seconds'] * 1e3:11.2f} {base / r['seconds']:6.2f}x {r['output']:9.2e} "
              f"{r['gradients']:9.2e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
