"""`--sweep`: a short measured training run for each of the planner's best layouts and the hand
layouts of an 8-device node, with planned against measured step time, tokens/s, peak memory,
communication share and bubble.

Each layout runs `python -m jaxllm.train.measure` (a training run of a few steps whose last two are
profiled) in a process of its own: the planner sits below the training stack and imports none of
it. A layout the config refuses (`validate`, or the run's own checks) keeps its row, with the
reason in place of the measurements.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping

from jaxllm.config import CHUNKED_SCHEDULES, ConfigError, RunConfig, validate
from jaxllm.parallel import timetable
from jaxllm.plan.estimate import Estimate, estimate
from jaxllm.plan.hardware import DEFAULT_EFFICIENCY, Accelerator, Efficiency, GiB
from jaxllm.plan.memory import memory
from jaxllm.plan.search import HEADROOM, Layout, search

NODE = 8  # the hand layouts are those of one node of 8 devices
MICROBATCHES = (1, 2, 4)  # a pipeline's microbatch counts, as multiples of its stages
TIMEOUT_S = 3600  # one layout's run


@dataclasses.dataclass
class Row:
    source: str  # 'plan #k' (the k-th fastest estimate) or 'hand'
    layout: Layout
    planned: dict | None = None
    measured: dict | None = None
    skipped: str | None = None  # why the layout was not measured

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "layout": dataclasses.asdict(self.layout),
            "overrides": self.layout.overrides(),
            "planned": self.planned,
            "measured": self.measured,
            "skipped": self.skipped,
        }


def describe(layout: Layout) -> str:
    """A layout in a few words: its mesh axes over 1, a pipeline's schedule, microbatches and
    repeats, remat and sequence parallelism where set."""
    axes = [f"{name} {n}" for name, n in (("tensor", layout.tensor), ("stage", layout.stage),
                                          ("fsdp", layout.fsdp), ("data", layout.data)) if n > 1]  # fmt: skip
    words = " × ".join(axes) or "one device"
    if layout.stage > 1:
        words += f", {layout.schedule}, {layout.microbatches} micro"
        words += f", {layout.repeats} repeats" if layout.repeats > 1 else ""
    words += f", remat {layout.remat}" if layout.remat != "none" else ""
    return words + (", seq-parallel" if layout.sequence_parallel else "")


def hand_layouts(cfg: RunConfig, gpus: int, multiples: Iterable[int] = MICROBATCHES) -> list[Layout]:
    """The three hand layouts of a node, the rest of `gpus` on `data`: tensor 8; stage 8 where the
    config's QKV groups allow it, else the deepest pipeline they allow; tensor 4 × stage 2. Each
    pipeline at `multiples` × its stages microbatches, those a data-parallel replica's rows allow
    (at least the first)."""
    own = Layout.of(cfg)
    groups = cfg.model.groups
    deepest = max((s for s in range(1, NODE + 1) if NODE % s == 0 and groups % s == 0), default=1)
    stage = NODE if deepest == 1 else deepest  # no pipeline fits: keep stage 8, which the config refuses
    out = []
    for tensor, stages in ((NODE, 1), (1, stage), (4, 2)):
        data = max(gpus // (tensor * stages), 1)
        base = dataclasses.replace(
            own, tensor=tensor, stage=stages, fsdp=1, data=data, microbatches=1, repeats=1, sequence_parallel=False,
            schedule=CHUNKED_SCHEDULES.get(own.schedule, own.schedule),
        )
        if stages == 1:
            out.append(base)
            continue
        rows = cfg.train.batch_size // cfg.train.grad_accum_steps // data
        counts = [stages * k for k in multiples]
        kept = [m for m in counts if m <= rows] or counts[:1]
        out += [dataclasses.replace(base, microbatches=m) for m in kept]
    return out


def planned(cfg: RunConfig, accelerator: Accelerator, efficiency: Efficiency) -> dict:
    """The planner's figures for `cfg`, and its terms at full efficiency (what `fit` fits)."""
    e: Estimate = estimate(cfg, accelerator, efficiency)
    unit = estimate(cfg, accelerator, Efficiency(1.0, 1.0))
    t, schedule = cfg.train, cfg.parallel.pipeline
    return {
        "step_s": e.step,
        "tokens_per_s": t.batch_size * t.seq_len / e.step,
        "peak_bytes": memory(cfg)["total"],
        "comm_share": e.comm_share,
        "bubble": timetable.bubble_of(schedule) if schedule is not None else None,
        "compute_s": unit.compute,
        "exposed_s": unit.exposed,
        "overlapped_s": unit.overlapped,
    }


def plan_rows(cfg: RunConfig, gpus: int, accelerator: Accelerator, top: int,
              efficiency: Efficiency = DEFAULT_EFFICIENCY, headroom: float = HEADROOM,
              multiples: Iterable[int] = MICROBATCHES) -> list[Row]:  # fmt: skip
    """The sweep's layouts, planned: the `top` fastest fitting ones of `search`, then the hand
    layouts not among them; a layout the config refuses carries the reason."""
    fitting = search(cfg, gpus, accelerator, headroom, efficiency).fitting
    rows = [Row(f"plan #{k}", c.layout) for k, c in enumerate(fitting[:top], 1)]
    planners = [r.layout for r in rows]
    rows += [Row("hand", layout) for layout in hand_layouts(cfg, gpus, multiples) if layout not in planners]
    for row in rows:
        try:
            candidate = row.layout.apply(cfg)
            validate(candidate, gpus)
        except ConfigError as e:
            row.skipped = f"refused: {e}"
            continue
        row.planned = planned(candidate, accelerator, efficiency)
    return rows


def measure_command(config: str, overrides: Mapping[str, str], layout: Layout, steps: int, workdir) -> list[str]:
    """The run that measures `layout`: `steps` steps, the last two profiled, every step logged."""
    return [
        sys.executable, "-m", "jaxllm.train.measure", "--config", config, "--workdir", str(workdir),
        *(f"--config.{k}={v}" for k, v in overrides.items()), *layout.overrides().split(),
        f"--config.train.steps={steps}", f"--config.train.profile_steps={steps - 1}:{steps}",
        "--config.train.log_every=1",
    ]  # fmt: skip


def _reason(output: str, returncode: int) -> str:
    """Why a run failed, from its output: its `error:` line (a ConfigError says what to change)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return "refused: " + errors[-1].removeprefix("error:").strip()
    return f"failed (exit {returncode}): {lines[-1] if lines else 'no output'}"


def measure(rows: list[Row], config: str, overrides: Mapping[str, str], steps: int, workdir, log=print) -> None:
    """Runs each planned row's layout (see `measure_command`) and fills in its measurements; each
    run's output is kept in its directory under `workdir` as `output.txt`."""
    if steps < 3:
        raise ConfigError(f"--sweep-steps={steps}: a sweep needs 3 or more (compile, time, profile)")
    todo = [r for r in rows if r.skipped is None]
    for k, row in enumerate(todo, 1):
        rundir = pathlib.Path(workdir) / f"{rows.index(row) + 1:02d}"
        shutil.rmtree(rundir, ignore_errors=True)  # a run resumes from a checkpoint it finds there
        rundir.mkdir(parents=True)
        log(f"[{k}/{len(todo)}] {describe(row.layout)}: {steps} steps in {rundir}")
        command = measure_command(config, overrides, row.layout, steps, rundir)
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=os.environ.copy())
        (rundir / "output.txt").write_text(proc.stdout + proc.stderr)
        result = rundir / "measured.json"
        if proc.returncode or not result.exists():
            row.skipped = _reason(proc.stdout + proc.stderr, proc.returncode)
        else:
            row.measured = json.loads(result.read_text())


def _num(x: float | None, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if unit == "%":
        return f"{x:.1%}"
    if unit == "MiB":
        return f"{x / 2**20:.4g}" if x < GiB else f"{x / GiB:.4g}G"
    return f"{x:.3g}"


COLUMNS = (("step s", "step_s", "step_time_s", ""), ("tokens/s", "tokens_per_s", "tokens_per_s", ""),
           ("peak MiB", "peak_bytes", "peak_bytes", "MiB"), ("comm", "comm_share", "comm_share", "%"),
           ("bubble", "bubble", "bubble", "%"))  # fmt: skip


def table(rows: list[Row], accelerator: Accelerator, backend: str | None = None) -> list[str]:
    """One line per layout: planned | measured for each column, or why it was not measured."""
    backend = backend or next((r.measured["backend"] for r in rows if r.measured), "?")
    width = max([len(describe(r.layout)) for r in rows] + [6]) + 2
    lines = [
        f"sweep: planned on {accelerator.label} | measured on {backend}",
        (f"  {'':<12}{'':<{width}}" + "".join(f"{c[0]:^23}" for c in COLUMNS)).rstrip(),
        f"  {'#':<3}{'source':<9}{'layout':<{width}}" + f"{'planned':>10} | {'measured':<10}" * len(COLUMNS),
    ]
    lines[-1] = lines[-1].rstrip()
    for i, r in enumerate(rows, 1):
        line = f"  {i:<3}{r.source:<9}{describe(r.layout):<{width}}"
        if r.planned is None:
            lines.append(line + (r.skipped or ""))
            continue
        for _, plan_key, measured_key, unit in COLUMNS:
            got = r.measured.get(measured_key) if r.measured else None
            line += f"{_num(r.planned[plan_key], unit):>10} | {_num(got, unit):<10}"
        lines.append(line.rstrip() + (f"  {r.skipped}" if r.skipped else ""))
    return lines


def fit_rows(rows: list[Row]) -> list[dict]:
    """The measured rows as `fit.fit` takes them."""
    return [{**{k: r.planned[k] for k in ("compute_s", "exposed_s", "overlapped_s")},
             "measured_step_s": r.measured["step_time_s"]} for r in rows if r.measured and r.planned]  # fmt: skip
