"""Metrics out: JSONL and TensorBoard in the workdir; device peak FLOPs for MFU."""

from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
from tensorboardX import SummaryWriter

from jaxllm.plan.hardware import accelerator_of


class MetricsWriter:
    """One JSON object per logged step in `metrics.jsonl`, the same scalars as TensorBoard events.
    Opening it for a run that resumes at `start_step` drops the lines after that step, so the file
    always reads as one clean run. Only JAX process 0 writes; on the others it does nothing."""

    def __init__(self, workdir: str | pathlib.Path, start_step: int = 0):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        self.dir = pathlib.Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        if path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True) if _step(line) <= start_step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)
        self._jsonl = open(path, "a")
        self._tb = SummaryWriter(str(self.dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        for name, value in metrics.items():
            self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._tb.close()


def _step(line: str) -> float:
    """The step of a metrics line; a line cut short by a killed process counts as after any step."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError):
        return float("inf")


def measure_matmul_peak(n: int = 1024, repeats: int = 10, dtype=jnp.float32, trials: int = 3) -> float:
    """FLOP/s of a large matmul on the first device: the practical peak (fp32 on a CPU). The best
    of a few trials, so a moment of contention from other processes does not pass for the peak."""
    # Random operands, each product from the same input: repeated squaring would drift into
    # denormals (slow on CPUs) or overflow, and zeros or ones run faster than real data on GPUs.
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            out = f(a)
        out.block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 * repeats / best


def peak_flops(devices: list) -> tuple[float, str]:
    """Aggregate peak FLOP/s of `devices` and where the figure comes from. Fake CPU devices share
    the host's cores, so on CPU the host's measured matmul peak is the whole budget."""
    kind = devices[0].device_kind
    if (accelerator := accelerator_of(kind)) is not None:
        return accelerator.bf16_flops * len(devices), f"{accelerator.label} bf16 table × {len(devices)}"
    if devices[0].platform == "cpu":
        return measure_matmul_peak(), "CPU fp32 matmul peak measured at start-up"
    return float("nan"), f"unknown for {kind!r}, so MFU is NaN; add it to ACCELERATORS in jaxllm/plan/hardware.py"


def memory_in_use() -> float | None:
    """Bytes in use on the first local device, where the backend reports it (GPUs do, CPU does not)."""
    stats = jax.local_devices()[0].memory_stats()
    return float(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None


def memory_fractions(stats: dict | None = None) -> dict[str, float]:
    """Memory in use and its peak as fractions of the device's capacity (`bytes_limit`), from the
    first local device's `memory_stats()` (or `stats`); empty where the backend reports none (CPU)."""
    stats = jax.local_devices()[0].memory_stats() if stats is None else stats
    if not stats or not stats.get("bytes_limit"):
        return {}
    limit = float(stats["bytes_limit"])
    out = {}
    if "bytes_in_use" in stats:
        out["memory_fraction"] = stats["bytes_in_use"] / limit
    if "peak_bytes_in_use" in stats:
        out["memory_peak_fraction"] = stats["peak_bytes_in_use"] / limit
    return out
