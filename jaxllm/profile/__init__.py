"""Profiles of training and serving steps: capture a `jax.profiler` trace of chosen steps
(`capture`), read the device time out of the trace file (`trace`), and check the three health
ratios against their bands (`health`). Training and serving both use it, so it sits below both."""

from jaxllm.profile.capture import StepProfiler
from jaxllm.profile.health import BANDS, OncePerRun, out_of_band
from jaxllm.profile.trace import CATEGORIES, COLLECTIVES, Summary, categorize, find_trace, read_ops, summarize

__all__ = [
    "BANDS", "CATEGORIES", "COLLECTIVES", "OncePerRun", "StepProfiler", "Summary", "categorize", "find_trace",
    "out_of_band", "read_ops", "summarize",
]  # fmt: skip
