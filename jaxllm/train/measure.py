"""`python -m jaxllm.train.measure --config configs/X.py [--config.a.b=value ...] --workdir DIR`: a
short training run that writes what `python -m jaxllm.plan --sweep` compares with its estimates to
`DIR/measured.json`:

- `step_time_s`: the median wall time of the steps after the first (which compiles) that no
  profile covers, else the profile's device time per step;
- `peak_bytes`: on GPUs the first device's `peak_bytes_in_use`; on CPU (no allocator statistics)
  the compiler's peak for the train step (`memory_analysis()`, as `--dry-run` reports it);
- `comm_share` and `bubble`: the profile of `train.profile_steps` (the run must set them);
- `tokens_per_s`, and the backend and device kind they were measured on.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

import jax
import numpy as np
from absl import logging

from jaxllm import cli
from jaxllm.config import RunConfig, load_config, step_range
from jaxllm.errors import exit_on_error
from jaxllm.train.dry_run import peak_bytes
from jaxllm.train.loop import Hooks, Loop, train

RESULT = "measured.json"


class PeakMemory(Hooks):
    """Reads the peak memory once the run's last step is done: the allocator's where the backend
    keeps statistics, else the compiler's for the step the run compiled."""

    def __init__(self):
        self.shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.peak: float | None = None
        self.source = ""

    def batch(self, step, batch):
        self.shapes = {k: (v.shape[1:], v.dtype) for k, v in batch.items()}
        return batch

    def stepped(self, step: int, loop: Loop) -> None:
        if step != loop.run.cfg.train.steps:
            return
        stats = jax.local_devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            self.peak, self.source = float(stats["peak_bytes_in_use"]), "peak_bytes_in_use"
            return
        size, sharding = loop.run.cfg.train.batch_size, loop.run.batch_sharding
        batch = {k: jax.ShapeDtypeStruct((size, *shape), dtype, sharding=sharding)
                 for k, (shape, dtype) in self.shapes.items()}  # fmt: skip
        compiled = loop.step_fn.lower(loop.state, batch).compile()
        self.peak, self.source = float(peak_bytes(compiled.memory_analysis())), "compiler memory_analysis"


def summarize_run(cfg: RunConfig, workdir: pathlib.Path, memory: PeakMemory) -> dict:
    """What `measured.json` holds, from the run's metrics.jsonl and `memory`."""
    t = cfg.train
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    first, last = step_range(t.profile_steps, "train.profile_steps") or (t.steps + 1, t.steps + 1)
    timed = [r["step_time_s"] for r in records if "step_time_s" in r and not first <= r["step"] <= last]
    profiled = next((r for r in records if "comm_share" in r), {})
    step_time = statistics.median(timed) if timed else profiled.get("profile_step_time_s", float("nan"))
    device = jax.devices()[0]
    return {
        "step_time_s": step_time,
        "step_time_source": "wall clock, unprofiled steps" if timed else "profile, device time",
        "tokens_per_s": t.batch_size * t.seq_len / step_time,
        "peak_bytes": memory.peak,
        "peak_source": memory.source,
        "comm_share": profiled.get("comm_share"),
        "bubble": profiled.get("bubble_measured"),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
    }


@exit_on_error
def main(argv: list[str] | None = None) -> None:
    parser = cli.parser("python -m jaxllm.train.measure", __doc__, [RunConfig])
    parser.add_argument("--config", required=True, help="a config file (configs/*.py)")
    parser.add_argument("--workdir", required=True, help="the run's directory; measured.json lands there")
    rest, texts = cli.split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    cli.quiet_jax_logs()
    logging.set_verbosity(logging.WARNING)
    cfg = load_config(args.config, cli.typed_overrides(texts))
    workdir = pathlib.Path(args.workdir)
    memory = PeakMemory()
    train(cfg, workdir, progress=False, hooks=memory)
    result = summarize_run(cfg, workdir, memory)
    (workdir / RESULT).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
