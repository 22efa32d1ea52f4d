"""`--dry-run`: lower and compile the real train step for the configured mesh on fake CPU devices,
with abstract inputs (nothing allocated), and print the compiler's memory and FLOPs per device
beside the planner's memory by component.

XLA:CPU stands in for a GPU compiler, with two differences the dry run corrects:
- it has no bf16 matmul, so it converts each bf16 operand to fp32; a pipeline's stage weights are
  loop-invariant, so it hoists their fp32 twins out of the loop and holds them all step, where a
  GPU multiplies the bf16 copies directly. The dry run compiles with while-loop invariant code
  motion off (`AS_ON_GPU`), and prints the default compile's peak beside it;
- the fused attention kernels exist only on GPUs: it compiles `xla` attention in their place,
  whose scores a fused kernel never materialises (an over-estimate).
"""

from __future__ import annotations

import math
import os
import sys
import time

import jax

from jaxllm import plan
from jaxllm.config import ConfigError, RunConfig, validate
from jaxllm.parallel.mesh import describe, make_mesh
from jaxllm.plan.comm import by_kind, communication
from jaxllm.plan.hlo import collective_bytes
from jaxllm.train.run import build_run
from jaxllm.train.step import compile_train_step

DEVICES_ENV = "JAXLLM_DRY_RUN_DEVICES"
AS_ON_GPU = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}  # see the module's doc


def ensure_fake_devices(cfg: RunConfig) -> None:
    """Re-executes this command (`python -m jaxllm.train ...`) on as many fake CPU devices as the
    mesh has, unless it already runs on them. Must run before JAX initialises a backend."""
    sizes = cfg.parallel.sizes
    if -1 in sizes.values():
        unsized = " ".join(f"--config.parallel.{axis}=N" for axis, n in sizes.items() if n == -1)
        raise ConfigError(f"--dry-run compiles for the mesh the config names, and {sizes} leaves an axis to the "
                          f"devices found (-1); give its size: {unsized}")  # fmt: skip
    devices = str(math.prod(sizes.values()))
    if os.environ.get(DEVICES_ENV) == devices:
        return
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    env = {**os.environ, DEVICES_ENV: devices, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    os.execve(sys.executable, [sys.executable, "-m", "jaxllm.train", *sys.argv[1:]], env)


def _gib(n: float) -> str:
    return f"{n / 2**30:10.2f} GiB"


BATCH_DTYPES = {"inputs": "int32", "targets": "int32", "segment_ids": "int32", "positions": "int32",
                "loss_mask": "float32"}  # what the data loader feeds  # fmt: skip


def lower_abstract_step(cfg: RunConfig, mesh: jax.sharding.Mesh) -> jax.stages.Lowered:
    """The train step lowered for `mesh` from shapes alone: nothing is allocated or read."""
    t = cfg.train
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        batch = {
            k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dtype, sharding=run.batch_sharding)
            for k, dtype in BATCH_DTYPES.items()
        }
        return compile_train_step(run).lower(run.state, batch)


def peak_bytes(mem) -> int:
    """The compiler's per-device peak: live arguments, outputs not written over them, temporaries."""
    return mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes


def dry_run(cfg: RunConfig) -> None:
    """`python -m jaxllm.train --dry-run`: the mesh, the planner's summary, the compiler's figures."""
    validate(cfg, jax.device_count())
    print(describe(make_mesh(cfg.parallel)))
    print(plan.summary(cfg), flush=True)
    compare_with_compiler(cfg)


def compare_with_compiler(cfg: RunConfig) -> None:
    """Compiles the train step for the configured mesh (the devices must be there: see
    `ensure_fake_devices`) and prints its memory and collectives beside the planner's."""
    validate(cfg, jax.device_count())
    mesh = make_mesh(cfg.parallel)
    if cfg.model.attention != "xla":
        print(f"model.attention={cfg.model.attention!r} runs on GPUs only: compiling 'xla' attention in its place")
        cfg = cfg.updated(model=dict(attention="xla"))
    start = time.perf_counter()
    lowered = lower_abstract_step(cfg, mesh)
    compiled = lowered.compile(compiler_options=AS_ON_GPU)
    print(f"lowered and compiled in {time.perf_counter() - start:.1f} s")
    mem = compiled.memory_analysis()
    print("per-device memory (compiler):")
    print(f"  arguments   {_gib(mem.argument_size_in_bytes)}  (params + optimizer state + batch)")
    aliased = _gib(mem.alias_size_in_bytes).strip()
    print(f"  outputs     {_gib(mem.output_size_in_bytes)}  ({aliased} aliased to donated inputs)")
    print(f"  temporaries {_gib(mem.temp_size_in_bytes)}")
    peak = peak_bytes(mem)
    print(f"  peak        {_gib(peak)}")
    cpu_peak = peak_bytes(lowered.compile().memory_analysis())
    print(f"  peak as XLA:CPU compiles by default: {_gib(cpu_peak).strip()} (+ fp32 twins of bf16 loop weights)")
    planned = plan.memory(cfg)
    print("per-device memory (planned by jaxllm.plan.memory):")
    print("\n".join(plan.memory_table(planned)))
    print(f"  planned total / compiler peak = {planned['total'] / peak:.2f}")
    flops = (compiled.cost_analysis() or {}).get("flops", float("nan"))
    t = cfg.train
    analytic = plan.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len / mesh.size
    print(
        f"FLOPs per device: compiler {flops:.3e} (each loop body counted once, per iteration), "
        f"model {analytic:.3e} per step (analytic)"
    )
    planned_collectives = by_kind(communication(cfg, backend=jax.default_backend()))
    collectives = collective_bytes(compiled.as_text())
    print("collectives per device per step, GB (the compiled program's, loops counted; the planner's):")
    if not collectives and not planned_collectives:
        print("  none: one device")
    for kind in sorted(set(collectives) | set(planned_collectives)):
        got, want = collectives.get(kind, 0.0), planned_collectives.get(kind, 0.0)
        ratio = want / got if got else float("nan")
        print(f"  {kind:<12}{got / 1e9:12.4f}{want / 1e9:12.4f}   planned / compiled = {ratio:.2f}")
