"""A `jax.profiler` trace of steps A..B (inclusive) of a loop, summarised when it ends."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping

import jax
import numpy as np

from jaxllm.config import Schedule
from jaxllm.profile.trace import Summary, find_trace, read_ops, summarize


class StepProfiler:
    """Call `before(step)` ahead of each step and `after(step, outputs)` once it is dispatched: the
    trace starts before step `first` (or the first step after it, on a resumed run), once the step
    before it is done, and stops once step `last`'s `outputs` are ready; `after` then returns the
    summary (else None). The trace
    (TensorBoard's profile plugin and Perfetto read it) lands in `logdir/plugins/profile/<run>/`."""

    def __init__(self, steps: tuple[int, int], logdir: str | pathlib.Path, *, module: str | None = None,
                 schedule: Schedule | None = None, stage_of: Mapping[str, int] | None = None,
                 loop_steps: int | None = None, on_summary: Callable[[Summary], None] | None = None):  # fmt: skip
        self.first, self.last = steps
        self.logdir = pathlib.Path(logdir)
        self.module, self.schedule, self.stage_of, self.on_summary = module, schedule, stage_of, on_summary
        self.loop_steps = loop_steps
        self.started: int | None = None
        self.done = False
        self.summary: Summary | None = None

    def covers(self, step: int) -> bool:
        return self.started is not None and not self.done and self.started <= step <= self.last

    def before(self, step: int) -> None:
        if not self.done and self.started is None and self.first <= step <= self.last:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir), create_perfetto_trace=True)
            self.started = step

    def after(self, step: int, outputs=None) -> Summary | None:
        if self.started is None and step + 1 == self.first:
            jax.block_until_ready(outputs)  # the step before is done: the trace holds only its own steps
        if self.started is None or self.done or step < self.last:
            return None
        jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.done = True
        ops = read_ops(find_trace(self.logdir), self.module)
        self.summary = summarize(
            ops, step - self.started + 1, schedule=self.schedule, stage_of=self.stage_of, loop_steps=self.loop_steps
        )
        (self.logdir / "summary.txt").write_text(self.summary.format() + "\n")
        if self.on_summary is not None:
            self.on_summary(self.summary)
        return self.summary

    def close(self) -> None:
        """Stops a trace still running (the loop ended early), without a summary."""
        if self.started is not None and not self.done:
            jax.profiler.stop_trace()
            self.done = True


def stages_of(mesh) -> dict[str, int]:
    """Each device's pipeline stage in `mesh` (axis 'stage'), by the trace's device key (its id)."""
    axis = mesh.axis_names.index("stage")
    return {str(d.id): int(idx[axis]) for idx, d in np.ndenumerate(mesh.devices)}
