"""The attention implementations on one GPU, side by side: each against `xla` (output and gradients
in bf16, packed documents), and forward + backward time as a ratio to `xla`.

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
    b, t, d = args.batch, args.seq, args.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, args.heads, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, t, args.kv_heads, d), jnp.bfloat16) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    # Two documents per row, split at different points, so masking across them would show.
    split = jnp.arange(t)[None, :] >= (jnp.arange(1, b + 1) * t // (b + 2))[:, None]
    segment_ids = split.astype(jnp.int32) + 1

    def step(implementation, q, k, v):
        attend = partial(layers.self_attention, segment_ids=segment_ids, implementation=implementation)
        out, backward = jax.vjp(lambda q, k, v: attend(q, k, v), q, k, v)
        return out, backward(cotangent)

    implementations = ["xla", "cudnn"] + (["pallas"] if args.kv_heads == args.heads else [])
    results = {impl: jax.jit(partial(step, impl)) for impl in implementations}
    reference = jax.tree.map(lambda a: np.asarray(a, np.float32), results["xla"](q, k, v))
    base = timed(results["xla"], q, k, v)
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; batch {b}, seq {t}, heads {args.heads}, "
          f"kv heads {args.kv_heads}, head dim {d}, bf16, packed documents")  # fmt: skip
    print(f"{'attention':>10} {'fwd+bwd ms':>11} {'vs xla':>7} {'max |Δ| out':>12} {'max |Δ| grads':>14}")
    for impl, fn in results.items():
        got = jax.tree.map(lambda a: np.asarray(a, np.float32), fn(q, k, v))
        out_err = float(np.abs(got[0] - reference[0]).max())
        grad_err = max(float(np.abs(g - r).max()) for g, r in zip(got[1], reference[1], strict=True))
        seconds = base if impl == "xla" else timed(fn, q, k, v)
        print(f"{impl:>10} {seconds * 1e3:11.2f} {base / seconds:6.2f}x {out_err:12.4f} {grad_err:14.4f}", flush=True)


if __name__ == "__main__":
    main()
