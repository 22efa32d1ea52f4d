"""The operator's three health ratios and their bands: device memory in use (80–85 % is the aim;
warned above 90 % or below 50 % of capacity), communication under 20 % of the step, pipeline
bubble under 15 %. `out_of_band` is a pure function of the numbers, so it is tested with given ones."""

from __future__ import annotations

from collections.abc import Mapping

from jaxllm.config import CHUNKED_SCHEDULES, SPLIT_SCHEDULES

# ratio: (lowest, highest) allowed
BANDS: dict[str, tuple[float, float]] = {
    "memory_peak_fraction": (0.50, 0.90),  # of the device's capacity (bytes_limit); reported by GPUs, not CPU
    "comm_share": (0.0, 0.20),  # collective time not hidden behind compute / step time
    "bubble_measured": (0.0, 0.15),  # see jaxllm.profile.trace.pipeline_bubble
}

_ADVICE = {
    ("memory_peak_fraction", "high"): "lower it with model.remat ('full' or 'group'), parallel.fsdp, "
    "parallel.offload_optimizer or a smaller train.batch_size",
    ("memory_peak_fraction", "low"): "use it with a larger train.batch_size, a lighter model.remat ('dots' or "
    "'none') or fewer parallel.fsdp shards",
    ("comm_share", "high"): "lower it with a smaller parallel.tensor (keep it within a node), parallel.fsdp "
    "instead of tensor, or the layout `python -m jaxllm.plan --search` prefers",
    ("bubble_measured", "high"): f"lower it with more parallel.microbatches, parallel.repeats > 1 (parallel.schedule "
    f"{', '.join(CHUNKED_SCHEDULES)}), a split backward ({', '.join(SPLIT_SCHEDULES)}), fewer parallel.stage, or "
    "the layout `python -m jaxllm.plan --search` prefers",
}


def out_of_band(ratios: Mapping[str, float]) -> dict[str, str]:
    """A warning for each ratio in `ratios` outside its band, by ratio name (absent ratios: none)."""
    warnings = {}
    for name, (low, high) in BANDS.items():
        value = ratios.get(name)
        if value is None:
            continue
        side = "high" if value > high else "low" if value < low else None
        if side is not None:
            band = f"{low:.0%}–{high:.0%}" if low > 0 else f"under {high:.0%}"
            warnings[name] = f"{name}={value:.1%} is outside its band ({band}); {_ADVICE[name, side]}"
    return warnings


class OncePerRun:
    """Which out-of-band warnings to print: each ratio's first only, however often it is out."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def new(self, ratios: Mapping[str, float]) -> list[str]:
        fresh = {name: w for name, w in out_of_band(ratios).items() if name not in self.warned}
        self.warned |= fresh.keys()
        return list(fresh.values())
