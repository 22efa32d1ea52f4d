"""FP8 projections: their error against fp32, the train-step time with and without them, and on a
GPU whether XLA turned every projection into a cuBLASLt FP8 GEMM; all side by side in one process.

    python scripts/bench_fp8.py [--config configs/tiny.py] [--batch B] [--seq T] [--steps 10]

On a CPU the FP8 step is an emulation (the dequantized dots run in the compute dtype): its time
shows the cost of the extra quantization work, not the speed of FP8 hardware.
"""

from __future__ import annotations

import argparse
import re
import sys
from functools import partial

import jax
import jax.numpy as jnp
from bench_gpu import run  # the train-step measurement, beside this script

from jaxllm.config import load_config, validate
from jaxllm.model.dense import einsum_projections
from jaxllm.model.fp8 import fp8_projections

SPEC = "bte,ehd->bthd"
FP8_GEMM = "__cublas$lt$matmul$f8"


def projection_errors(dtype) -> dict[str, list[float]]:
    """Norm-relative error against fp32 of the forward, dx and dw of a q-like projection."""
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (8, 256, 1024))
    w = jax.random.normal(k[1], (1024, 16, 64)) * 0.02
    g = jax.random.normal(k[2], (8, 256, 16, 64)) * 1e-3

    @partial(jax.jit, static_argnums=3)
    def grads(x, w, g, project):
        out, vjp = jax.vjp(lambda x, w: project(x, (w,), SPEC)[0], x, w)
        return (out, *vjp(g.astype(out.dtype)))

    def exact(x, ws, spec):
        return tuple(jnp.einsum(spec, x, w, precision="highest") for w in ws)

    want = grads(x, w, g, exact)
    errors = {}
    for name, project in (("bf16 einsum", einsum_projections), ("fp8", fp8_projections("global"))):
        got = grads(x.astype(dtype), w, g, project)
        errors[name] = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(got, want, strict=True)]
    return errors


def fp8_gemms(hlo: str, model) -> tuple[int, int]:
    """The cuBLASLt FP8 GEMMs in an optimized train step's HLO, and how many there should be: every
    projection's forward and two backward dots, per layer of the scanned group's body."""
    return len(re.findall(re.escape(FP8_GEMM), hlo)), 3 * 7 * model.qkv_share_every


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--batch", type=int, help="default: the config's train.batch_size")
    parser.add_argument("--seq", type=int, help="default: the config's train.seq_len")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    gpu = jax.default_backend() == "gpu"

    print("error against fp32, norm-relative:   forward       dx        dw")
    for name, errs in projection_errors(jnp.bfloat16).items():
        print(f"  {name:<33}" + "".join(f"{e:>10.2e}" for e in errs))

    cfg = load_config(args.config)
    cfg = cfg.updated(model=dict(dtype="bfloat16"), parallel=dict(data=1, fsdp=1, stage=1, tensor=1))
    t = cfg.train
    cfg = cfg.updated(train=dict(batch_size=args.batch or t.batch_size, seq_len=args.seq or t.seq_len,
                                 grad_accum_steps=1))  # fmt: skip
    runs = {}
    for fp8 in (False, True):
        cfg = cfg.updated(model=dict(fp8=dict(enabled=fp8)))
        validate(cfg, 1, jax.default_backend())
        runs[fp8] = run(cfg, args.steps)
    times, hlo = {fp8: r["step_s"] for fp8, r in runs.items()}, runs[True]["hlo"]
    label = "" if gpu else " (CPU emulation: the quantization's cost, not FP8 speed)"
    shape = f"{args.config}, batch {t.batch_size} × {t.seq_len}, bf16"
    print(f"train step, {shape}: {times[False] * 1e3:.1f} ms; with FP8 {times[True] * 1e3:.1f} ms")
    print(f"FP8 / bf16 step time: {times[True] / times[False]:.2f}{label}")
    if not gpu:
        return 0
    gemms, want = fp8_gemms(hlo, cfg.model)
    layers = cfg.model.qkv_share_every
    print(f"cuBLASLt FP8 GEMMs in the optimized HLO: {gemms} (7 projections × 3 dots × {layers} layers = {want})")
    return 0 if gemms >= want else 1


if __name__ == "__main__":
    sys.exit(main())
