"""`--plot out.png`: memory per device by component, and the pipeline schedule (stage × iteration,
or for 1F1B each stage's forwards, backwards (and zero-bubble's weight passes) × step; bubbles
shaded). Needs matplotlib (the
`plot` extra)."""

from __future__ import annotations

import numpy as np

from jaxllm.config import TABLE_SCHEDULES, RunConfig, Schedule
from jaxllm.parallel import timetable
from jaxllm.parallel.timetable import IDLE
from jaxllm.plan.hardware import ACCELERATORS, GiB
from jaxllm.plan.memory import memory
from jaxllm.plan.search import HEADROOM

BUBBLE = -1


def schedule_grid(schedule: Schedule) -> np.ndarray:
    """[stages, iterations]: the microbatch each stage works on in each iteration (as the pipeline
    runs them: iteration k of stage s takes microbatch (k − s) mod M of repeat (k − s) // M), or
    BUBBLE where it has none."""
    k = np.arange(schedule.iterations)[None, :] - np.arange(schedule.stages)[:, None]
    busy = (k >= 0) & (k < schedule.repeats * schedule.microbatches)
    return np.where(busy, k % schedule.microbatches, BUBBLE)


def timetable_parts(table: timetable.Timetable) -> tuple[str, ...]:
    """The kinds of work a timetable's stages run: forward, backward, and weight pass if split."""
    return ("F", "B", "W") if table.split else ("F", "B")


def timetable_grid(schedule: Schedule) -> np.ndarray:
    """[parts·stages, steps] of a timetable-driven schedule (`timetable_parts`): row k·s + i the
    microbatch stage s runs part i of in each step (forward, backward, weight pass), or BUBBLE."""
    table = timetable.of(schedule)
    units = (table.forward, table.backward, table.weight)[: len(timetable_parts(table))]
    rows = np.empty((len(units) * schedule.stages, table.steps), dtype=int)
    for column, unit in enumerate(units):
        rows[column :: len(units)] = np.where(unit.T == IDLE, BUBBLE, unit.T % schedule.microbatches)
    return rows


def schedule_picture(schedule: Schedule) -> dict:
    """What a drawing of `schedule` shows, as plain data (the docs' pictures digest it)."""
    table = schedule.kind in TABLE_SCHEDULES
    grid = timetable_grid(schedule) if table else schedule_grid(schedule)
    bubble = round(timetable.bubble_of(schedule), 6)
    parts = timetable_parts(timetable.of(schedule)) if table else ()
    return {**schedule._asdict(), "bubble": bubble, "table": table, "parts": parts, "grid": grid.tolist()}


def draw_schedule(ax, picture: dict) -> None:
    grid = np.asarray(picture["grid"])
    ax.imshow(np.ones_like(grid), cmap="Greys", vmin=0, vmax=4, aspect="auto")  # bubbles: grey
    if picture["table"]:  # forwards, backwards and weight passes each in their own palette
        parts = picture["parts"]
        for i, cmap in enumerate(("viridis", "plasma", "cividis")[: len(parts)]):
            shown = np.full(grid.shape, BUBBLE)
            shown[i :: len(parts)] = grid[i :: len(parts)]
            ax.imshow(np.ma.masked_equal(shown, BUBBLE), cmap=cmap, aspect="auto", interpolation="nearest")
        labels = [f"{s} {part}" for s in range(picture["stages"]) for part in parts]
        names = ", ".join(f"{n} ({p})" for n, p in zip(("forward", "backward", "weight pass"), parts, strict=False))
        ax.set(xlabel="step", ylabel=f"stage: {names}", yticks=range(len(labels)), yticklabels=labels)
    else:
        ax.imshow(np.ma.masked_equal(grid, BUBBLE), cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set(xlabel="iteration", ylabel="stage", yticks=range(picture["stages"]))
    for (row, column), micro in np.ndenumerate(grid):
        if micro != BUBBLE:
            ax.text(column, row, str(micro), ha="center", va="center", fontsize=6, color="white")
    ax.set_title(
        f"pipeline {picture['kind']}: {picture['stages']} stages × {picture['repeats']} chunks, "
        f"{picture['microbatches']} microbatches; bubble (grey) {picture['bubble']:.1%}"
    )


CELL_KINDS = {  # what a stage runs in a timetable's step → colour
    "forward": "#3182bd", "backward": "#e6550d", "forward and backward": "#756bb1", "share of the loss only": "#31a354",
    "weight pass only": "#fdd0a2", "with a weight pass": "#8c6d31",
}  # fmt: skip


def draw_measured_steps(ax, schedule: Schedule, work: np.ndarray, bubble: float) -> None:
    """A profiled step of a timetable-driven `schedule`: each step of its loop as long as its busiest
    stage's `work` [steps, stages] (seconds), each stage's work a bar coloured by what the table
    has it run there, the rest of the step grey: the measured bubble, beside the table's picture."""
    table = timetable.of(schedule)
    forward, backward, weight = table.forward != IDLE, table.backward != IDLE, table.weight != IDLE
    loss = np.broadcast_to(table.loss_steps[:, None], forward.shape)
    starts = np.concatenate([[0.0], np.cumsum(work.max(axis=1))]) * 1e3
    ax.barh(range(schedule.stages), starts[-1], left=0, color="#d9d9d9", height=0.8)  # idle unless covered
    for step, stage in np.ndindex(work.shape):
        f, b, w = forward[step, stage], backward[step, stage], weight[step, stage]
        kind = "forward and backward" if f and b else "forward" if f else "backward" if b else None
        kind = "with a weight pass" if w and kind else "weight pass only" if w else kind
        kind = kind or ("share of the loss only" if loss[step, stage] else None)
        if kind:
            ax.barh(stage, work[step, stage] * 1e3, left=starts[step], color=CELL_KINDS[kind], height=0.8,
                    edgecolor="white", linewidth=0.5)  # fmt: skip
    for kind, colour in CELL_KINDS.items():
        ax.barh(0, 0, color=colour, label=kind)
    ax.barh(0, 0, color="#d9d9d9", label="idle: the bubble")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncols=5, fontsize=7)
    ax.set(xlabel="ms (each loop step as long as its busiest stage)", ylabel="stage", yticks=range(schedule.stages))
    ax.invert_yaxis()
    ax.set_title(f"profiled {schedule.kind}: {schedule.stages} stages × {schedule.repeats} chunks, "
                 f"{schedule.microbatches} microbatches; measured bubble {bubble:.1%}")  # fmt: skip


def draw_memory(ax, planned: dict[str, float], title: str = "memory per device, by component") -> None:
    """`planned` (the planner's bytes by component) as one stacked bar, with each GPU's budget."""
    bottom = 0.0
    for name, n in planned.items():
        if name != "total" and "host" not in name:
            ax.bar(0, n / GiB, bottom=bottom, label=name)
            bottom += n / GiB
    budgets = {}  # GiB after headroom → the devices with about that much memory
    for name, accelerator in ACCELERATORS.items():
        budgets.setdefault(round(accelerator.memory * (1 - HEADROOM) / GiB), []).append(name)
    for budget, names in budgets.items():
        ax.axhline(budget, linestyle="--", linewidth=1, color="gray")
        ax.annotate(f"{', '.join(names)} less {HEADROOM:.0%}", (-0.38, budget), fontsize=7, va="bottom")
    ax.set(xticks=[], ylabel="GiB per device", title=title)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.02))


def plot(cfg: RunConfig, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[plot]'") from e
    fig, (mem_ax, pipe_ax) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1, 3]})
    draw_memory(mem_ax, memory(cfg))
    if (schedule := cfg.parallel.pipeline) is None:
        pipe_ax.text(0.5, 0.5, "no pipeline (parallel.stage = 1)", ha="center", va="center")
        pipe_ax.set_axis_off()
    else:
        draw_schedule(pipe_ax, schedule_picture(schedule))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
