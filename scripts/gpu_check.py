"""Every claim the docs make about GPUs, checked on one GPU in one run: a line per claim, PASS or
FAIL with its figure and the bound it is held to, most wanted first, then a count. The exit status
is 1 when a claim fails. `bash scripts/gpu_check.sh` runs it.

    python scripts/gpu_check.py [--config configs/1b.py] [--config.a.b=value ...] [--batch 8] [--seq 2048]
        [--steps 3] [--only CHECK ...]

- attention: cudnn and pallas attention against xla (bf16, packed documents, batch 2 × 4096, 16
  heads of 128, and cudnn with 4 kv heads): output and gradients within 2 % (norm-relative),
  forward + backward faster.
- train: the config's step on one GPU for each remat policy (full, selective): MFU within 30 % of
  the planner's estimate for this device, and the compiler's memory (arguments + temporaries)
  within 10 % of the device's measured peak.
  Then, in the same check, one more `selective` step traced with jax.profiler (into $OUT/profile
  when $OUT is set) and summarised from the trace file: its device time per step within 25 % of
  the timed step, and matmuls the largest category.
- fp8: the projections' error against fp32 within the formats' rounding (2^-4 forward in e4m3,
  2^-3 backward in e5m2), the FP8 step faster than bf16, and a cuBLASLt FP8 GEMM in the optimized
  HLO for each projection's three dots (the last two skipped on a GPU without FP8, an A100).
- decode: the serving engine (bf16 weights and cache, the Pallas paged kernel) at 1 and 8 busy
  sequences, at least half the planner's bandwidth limit for this device; and the paged kernel
  equal to the XLA path (`tests/unit/test_engine.py`).
- savings: device memory in use for int8 weights and an int8 KV cache against bf16 (their ratio
  within 2 points of the planner's ratio of their bytes), and after a train step with the optimizer state in host
  memory against on the device (at least 90 % of the state's bytes saved).

Without a GPU the same code runs (tests/e2e/test_gpu_check.py runs it on CPU with the 1B config
shrunk): what only a GPU can show prints SKIP with the reason. That proves the script, not the claims.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import compare  # the benchmarks beside this script
from bench_fp8 import fp8_gemms, projection_errors
from bench_gpu import run
from bench_serve import engine_rates

from jaxllm import cli, plan
from jaxllm.checkpoint import quantize_params
from jaxllm.config import load_config, validate
from jaxllm.data.tokenizer import get_tokenizer
from jaxllm.model.cache import KVCache
from jaxllm.parallel.mesh import make_mesh
from jaxllm.plan.estimate import estimate
from jaxllm.plan.hardware import accelerator_of
from jaxllm.serve.engine import Engine
from jaxllm.serve.load import build_engine
from jaxllm.serve.settings import ServeConfig, serving_config
from jaxllm.train.metrics import memory_in_use, peak_flops
from jaxllm.train.run import HOST
from jaxllm.train.step import init_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU = jax.default_backend() == "gpu"
ACCELERATOR = accelerator_of(jax.devices()[0].device_kind)
KV_DTYPES = {"bf16": "bfloat16", "int8": "int8"}
NO_PLANNER = f"the planner has no figures for {jax.devices()[0].device_kind!r}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    claim: str
    passed: bool | None  # None: skipped, and `figure` says why
    figure: str

    def line(self) -> str:
        word = {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]
        return f"{word}  {self.claim}: {self.figure}"


def judged(claim: str, passed: bool, figure: str, gpu_only: str = "") -> Verdict:
    """`passed` on a GPU; elsewhere a claim about GPUs (`gpu_only` says why) is skipped, figure shown."""
    if gpu_only and not GPU:
        return Verdict(claim, None, f"{figure} (not judged: {gpu_only})")
    return Verdict(claim, passed, figure)


def one_device(cfg, **train):
    """`cfg` on one device, without gradient accumulation."""
    cfg = cfg.updated(parallel=dict(data=1, fsdp=1, stage=1, tensor=1), train=dict(grad_accum_steps=1, **train))
    validate(cfg, 1, jax.default_backend())
    return cfg


def device_bytes(make: Callable[[], object]) -> tuple[object, float]:
    """What `make` returns and the device memory it holds: the allocator's figure where the backend
    keeps one, else the arrays' own bytes."""
    before = memory_in_use()
    out = jax.block_until_ready(make())
    after = memory_in_use()
    held = after - before if before is not None else sum(a.nbytes for a in jax.tree.leaves(out))
    return out, held


def ratio_verdict(claim: str, held: dict[str, float], planned: float, why: str) -> Verdict:
    """int8's bytes over bf16's in `held`, judged against the planner's ratio `planned`."""
    ratio = held["int8"] / held["bf16"]
    figure = (f"{held['int8'] / 2**30:.3g} GiB against {held['bf16'] / 2**30:.3g} bf16 ({ratio:.1%}; the planner's "
              f"{planned:.1%}, bound ±2 points)")  # fmt: skip
    return judged(claim, abs(ratio - planned) <= 0.02, figure, why)


# ---- the checks ----


def attention(args) -> Iterator[Verdict]:
    if not GPU:
        yield Verdict("attention", None, "cudnn and pallas attention are GPU kernels")
        return
    for kv_heads in (16, 4):  # pallas takes no GQA: with 4 kv heads, cudnn only
        rows = compare(2, args.attention_seq, 16, kv_heads, 128)
        base = rows.pop("xla")["seconds"]
        for impl, r in rows.items():
            name, error = f"{impl} attention ({kv_heads} kv heads)", max(r["output"], r["gradients"])
            yield Verdict(f"{name} equals xla", error <= 0.02,
                          f"output {r['output']:.2e}, gradients {r['gradients']:.2e} (bound 2.00e-02)")  # fmt: skip
            speed = f"{base / r['seconds']:.2f}× ({r['seconds'] * 1e3:.2f} ms against {base * 1e3:.2f})"
            yield Verdict(f"{name} is faster than xla", r["seconds"] < base, speed)


def train(args) -> Iterator[Verdict]:
    cfg = one_device(args.cfg, batch_size=args.batch, seq_len=args.seq)
    peak, source = peak_flops(jax.devices()[:1])
    flops = plan.flops_per_token(cfg.model, args.seq) * args.batch * args.seq
    for remat in ("full", "selective"):  # the device's peak is the process's: least memory first
        cfg = cfg.updated(model=dict(remat=remat))
        profile_dir = None
        if remat == "selective":
            profile_dir = os.path.join(os.environ["OUT"], "profile") if "OUT" in os.environ else tempfile.mkdtemp()
        r = run(cfg, args.steps, profile_dir)
        mfu = flops / r["step_s"] / peak
        figure = f"{mfu:.1%} MFU ({source}), {r['step_s']:.3f} s a step"
        if ACCELERATOR is None:
            yield Verdict(f"train MFU near the planner's, remat {remat}", None, f"{figure}; {NO_PLANNER}")
        else:
            planned = estimate(cfg, ACCELERATOR).mfu
            yield judged(f"train MFU near the planner's, remat {remat}", abs(mfu / planned - 1) <= 0.3,
                         f"{figure} against {planned:.1%} planned (bound ±30 %)")  # fmt: skip
        measured = r["measured_peak_gib"]
        yield judged(f"compiled memory near the measured peak, remat {remat}",
                     abs(r["compiled_gib"] / measured - 1) <= 0.1,
                     f"compiled {r['compiled_gib']:.2f} GiB, measured {measured:.2f} GiB (bound ±10 %)",
                     "this backend reports no allocator peak")  # fmt: skip
        if r["profile"] is not None:
            yield from profile(r["profile"], r["step_s"])


def profile(summary, step_s: float) -> Iterator[Verdict]:
    if isinstance(summary, Exception):  # the trace failed, not the step
        yield Verdict("profile of one step", False, f"{type(summary).__name__}: {summary}")
        return
    print(summary.format(), flush=True)
    largest = max(summary.categories, key=summary.categories.get)
    yield judged("profile of one step: device time matches the step", abs(summary.step_time / step_s - 1) <= 0.25,
                 f"{summary.step_time * 1e3:.1f} ms traced, {step_s * 1e3:.1f} ms timed (bound ±25 %)",
                 "fake devices share the host's cores")  # fmt: skip
    yield judged("profile of one step: matmuls take the most time", largest == "matmul",
                 f"largest category {largest} ({summary.categories[largest] / summary.step_time:.1%})",
                 "CPU matmuls are not a GPU's")  # fmt: skip


def fp8(args) -> Iterator[Verdict]:
    errors = projection_errors(jnp.bfloat16)["fp8"]
    for name, error, bound in zip(("forward", "dx", "dw"), errors, (2**-4, 2**-3, 2**-3), strict=True):
        yield Verdict(f"fp8 projection {name} error", error <= bound, f"{error:.2e} (bound {bound:.2e})")
    cfg = one_device(args.cfg, batch_size=args.batch, seq_len=args.seq)
    cfg = cfg.updated(model=dict(dtype="bfloat16", remat="selective"))
    runs = {on: run(cfg.updated(model=dict(fp8=dict(enabled=on))), args.steps) for on in (False, True)}
    ratio = runs[True]["step_s"] / runs[False]["step_s"]
    gemms, want = fp8_gemms(runs[True]["hlo"], cfg.model)
    layers = cfg.model.qkv_share_every
    figures = {
        "fp8 train step faster than bf16": (ratio < 1.0, f"FP8 / bf16 step time {ratio:.2f}"),
        "fp8 projections are cuBLASLt FP8 GEMMs": (
            gemms >= want,
            f"{gemms} in the optimized HLO (7 projections × 3 dots × {layers} layers = {want})",
        ),
    }
    no_fp8 = ACCELERATOR is not None and ACCELERATOR.fp8_flops <= ACCELERATOR.bf16_flops
    for claim, (passed, figure) in figures.items():
        if no_fp8:
            yield Verdict(claim, None, f"{figure} (not judged: the {ACCELERATOR.kind} has no FP8 units)")
        else:
            yield judged(claim, passed, figure, "FP8 on CPU is an emulation of cuBLASLt's")


def engine(cfg, slots: int, max_len: int) -> Engine:
    settings = ServeConfig(slots=slots, max_len=max_len, max_prompt_tokens=max_len // 2, dtype="bfloat16",
                           rate_per_s=1e9, burst=10**9)  # fmt: skip
    serving = serving_config(cfg, settings, 1, jax.default_backend())
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), init_params(cfg))
    mesh = make_mesh(serving.parallel, jax.devices()[:1])
    return build_engine(params, serving, get_tokenizer(cfg.data.tokenizer), mesh)


def decode(args) -> Iterator[Verdict]:
    cfg = one_device(args.cfg, seq_len=args.seq)
    context, new = args.decode_context, 64
    server = engine(cfg, 8, 2 * context)
    prompts = np.random.default_rng(0).integers(0, server.vocab_size, (8, context))
    rates = engine_rates(server, prompts, new, repeats=2)
    for n in (1, 8):
        figure = f"{rates[f'decode_{n}']:,.0f} tokens/s at {n} sequence(s) of {context} tokens"
        if ACCELERATOR is None:
            yield Verdict(f"decode near the bandwidth limit, {n} sequence(s)", None, f"{figure}; {NO_PLANNER}")
            continue
        limit = plan.decode_limit(cfg.model, n, context + new // 2, ACCELERATOR.hbm)
        share = rates[f"decode_{n}"] / limit
        yield Verdict(f"decode near the bandwidth limit, {n} sequence(s)", share >= 0.5,
                      f"{figure}, {share:.0%} of the planner's {limit:,.0f} (bound ≥ 50 %)")  # fmt: skip
    if not GPU:
        yield Verdict("paged attention kernel equals the XLA path", None, "the suite runs it in the Pallas interpreter")
        return
    try:
        import pytest  # noqa: F401  (the kernel's check is a test of the suite)
    except ImportError:
        yield Verdict("paged attention kernel equals the XLA path", None, "pytest is not installed here")
        return
    test = "tests/unit/test_engine.py::test_the_pallas_paged_kernel_equals_the_xla_path"
    # Its own process, beside this one's GPU memory: allocate as it goes rather than 75 % up front.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT,
                            env=env, capture_output=True, text=True)  # fmt: skip
    yield Verdict("paged attention kernel equals the XLA path", result.returncode == 0,
                  (result.stdout.strip().splitlines() or [result.stderr.strip()])[-1])  # fmt: skip


def savings(args) -> Iterator[Verdict]:
    cfg = one_device(args.cfg, batch_size=args.batch, seq_len=args.seq)
    mesh = make_mesh(cfg.parallel, jax.devices()[:1])
    params = init_params(cfg)
    why = "this backend reports no allocator figures"
    weights = {}
    for name, quantize in (("bf16", None), ("int8", "int8")):
        model = cfg.model.replace(quantize=quantize)
        make = (lambda m=model: quantize_params(params, m, mesh, jnp.bfloat16)) if quantize else (
            lambda: jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))  # fmt: skip
        arrays, weights[name] = device_bytes(make)
        del arrays
    planned = plan.weight_bytes(cfg.model)
    yield ratio_verdict("int8 weights save device memory", weights, planned["int8 as served"] / planned["bf16"], why)
    caches = {}
    for dtype in ("bf16", "int8"):
        make = lambda d=dtype: KVCache.empty(cfg.model, slots=8, max_len=args.seq, dtype=KV_DTYPES[d])  # noqa: E731
        arrays, caches[dtype] = device_bytes(make)
        del arrays
    planned = {dtype: plan.kv_cache_bytes(cfg.model, 8, args.seq, dtype) for dtype in ("bf16", "int8")}
    yield ratio_verdict("an int8 KV cache saves device memory", caches, planned["int8"] / planned["bf16"], why)
    if not any(m.kind == HOST for m in jax.devices()[0].addressable_memories()):
        yield Verdict("host offload of the optimizer state saves device memory", None, "no pinned_host memory here")
        return
    cfg = cfg.updated(model=dict(remat="full"))
    resident = {on: run(cfg.updated(parallel=dict(offload_optimizer=on)), 1)["resident_gib"] for on in (False, True)}
    state = plan.memory(cfg)["optimizer state (Adam m, v)"] / 2**30
    saved = resident[False] - resident[True]
    yield judged("host offload of the optimizer state saves device memory", saved >= 0.9 * state,
                 f"{saved:.2f} GiB less in use after a step (the state: {state:.2f} GiB, bound ≥ 90 %)",
                 why)  # fmt: skip


CHECKS = {"attention": attention, "train": train, "fp8": fp8, "decode": decode, "savings": savings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/1b.py")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attention-seq", type=int, default=4096)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    rest, texts = cli.split_overrides(sys.argv[1:])
    args = parser.parse_args(rest)
    args.cfg = load_config(args.config, cli.typed_overrides(texts))
    device = jax.devices()[0]
    print(f"{device.device_kind} ({device.platform}); jax {jax.__version__}; {args.config}, batch {args.batch} × "
          f"{args.seq}", flush=True)  # fmt: skip
    verdicts = []
    for name in (name for name in CHECKS if name in args.only):  # in order: the device's peak is the process's
        start = time.perf_counter()
        try:
            for verdict in CHECKS[name](args):
                verdicts.append(verdict)
                print(verdict.line(), flush=True)
        except Exception as error:  # one broken check must not hide the others' figures
            verdicts.append(Verdict(name, False, f"{type(error).__name__}: {error}"))
            print(verdicts[-1].line(), flush=True)
        print(f"      ({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    counts = {word: sum(v.passed is value for v in verdicts) for word, value in (("passed", True), ("failed", False),
                                                                                 ("skipped", None))}  # fmt: skip
    print(", ".join(f"{n} {word}" for word, n in counts.items()))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
