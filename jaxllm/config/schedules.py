"""The pipeline schedules a config can name, the kinds they fall into, and `Schedule`, a pipeline's
stages, chunks and microbatches with the bubble that follows from them."""

from __future__ import annotations

import typing
from typing import Literal, NamedTuple

PipelineSchedule = Literal["gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble", "interleaved_zero_bubble"]
# Schedules run by a timetable (`parallel/timetable.py`) rather than as a forward loop JAX transposes.
TABLE_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "interleaved_zero_bubble")
# Timetable schedules whose backward is split (`parallel/split_backward.py`): the weight gradients
# put off, the forward keeping what the remat policy keeps rather than recomputed from the stage input.
SPLIT_SCHEDULES = ("zero_bubble", "interleaved_zero_bubble")
# The schedules whose stages each hold `repeats` chunks, and each one's schedule of one chunk a stage.
CHUNKED_SCHEDULES = {"circular": "gpipe", "interleaved_1f1b": "1f1b", "interleaved_zero_bubble": "zero_bubble"}
PIPELINE_SCHEDULES = typing.get_args(PipelineSchedule)


class Schedule(NamedTuple):
    """A pipeline's schedule (see `parallel/schedule.py` for the views it puts on groups)."""

    stages: int
    repeats: int
    microbatches: int
    kind: str = "gpipe"

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def split(self) -> bool:
        """Whether each backward is split, its weight gradients put off (`SPLIT_SCHEDULES`)."""
        return self.kind in SPLIT_SCHEDULES

    @property
    def bubble(self) -> float:
        """Fraction of stage-iterations that do no useful work: the same for 1F1B as for GPipe, and
        for interleaved 1F1B as for the circular schedule (`parallel/timetable.py` derives it from
        each timetable). Not the split schedules': `timetable.bubble_of` reads theirs off the table."""
        return (self.stages - 1) / self.iterations
