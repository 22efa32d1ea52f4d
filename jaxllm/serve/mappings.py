"""A server's programs against the kernel's limit on a process's memory mappings.

XLA:CPU maps each loaded program's code in regions of its own (hundreds for a server's steps), and
Linux lets a process hold `vm.max_map_count` of them (65,530 by default). Past the
limit XLA's loader segfaults at the next compile, with no message. A server compiles a program per
bucket (a few hundred at long `serve.max_len` with many slots), so `MappingBudget` watches the
start-up's compiles and stops it, naming the fix, as soon as the rest would not fit. On
accelerators a program's code lives on the device and the count barely moves; off Linux there is
nothing to read and it checks nothing.
"""

from __future__ import annotations

import pathlib

from jaxllm.errors import JaxllmError
from jaxllm.serve.runner import Progress, no_progress

MAPS, LIMIT = pathlib.Path("/proc/self/maps"), pathlib.Path("/proc/sys/vm/max_map_count")
HEADROOM = 0.9  # of the limit: what the server maps once it runs (threads, buffers) is not counted yet
ESTIMATED_FROM = 8  # programs: the first few differ in size (a verify step's is larger than a plain one's)


class MappingLimitError(JaxllmError):
    """The server's programs would map more regions than the kernel lets a process hold."""


def mappings() -> int | None:
    """The memory mappings this process holds now (None where /proc does not say)."""
    try:
        with MAPS.open("rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def kernel_limit() -> int | None:
    """vm.max_map_count (None where /proc does not say)."""
    try:
        return int(LIMIT.read_text())
    except (OSError, ValueError):
        return None


class MappingBudget:
    """A `Progress` that passes each report on to `progress` and, once `ESTIMATED_FROM` programs
    are in and every `ESTIMATED_FROM` after, projects the mappings all `total` will hold from what
    each added after the first: past `HEADROOM` of `limit` (the kernel's unless given) it raises
    `MappingLimitError`."""

    def __init__(self, progress: Progress = no_progress, limit: int | None = None):
        self.progress, self.limit = progress, kernel_limit() if limit is None else limit
        self.baseline: tuple[int, int] | None = None  # (programs, mappings) at the first read, one-off costs in

    def __call__(self, done: int, total: int) -> None:
        self.progress(done, total)
        if done not in (1, total) and done % ESTIMATED_FROM:  # a read takes 50 ms at 65,000 mappings
            return
        held = mappings()
        if held is None or self.limit is None:
            return
        if self.baseline is None:
            self.baseline = (done, held)
            return
        each, projected = projection(self.baseline, (done, held), total)
        if projected > HEADROOM * self.limit:
            raise MappingLimitError(
                f"serving compiles {total} programs, and each maps about {each:.0f} memory regions here: the "
                f"process would hold about {projected:,.0f} of the {self.limit:,} the kernel allows "
                f"(vm.max_map_count), past which XLA crashes. Raise the limit (as root: sysctl -w "
                f"vm.max_map_count={_enough(projected)}), or compile fewer programs: a smaller "
                "--config.serve.max_len, --config.serve.slots or --config.serve.prefill_chunk, or no speculative "
                "decoding (a verify step for each decode bucket)"
            )

    def summary(self) -> str:
        """What the process holds of the limit now, for the start-up's log line ('' where unknown)."""
        held = mappings()
        if held is None or self.limit is None:
            return ""
        return f"; the process holds {held:,} memory mappings of the {self.limit:,} the kernel allows"


def projection(baseline: tuple[int, int], now: tuple[int, int], total: int) -> tuple[float, float]:
    """(mappings a program adds, mappings once all `total` are in), from (programs, mappings) at a
    `baseline` and `now`."""
    each = max(now[1] - baseline[1], 0) / (now[0] - baseline[0])
    return each, now[1] + each * (total - now[0])


def _enough(projected: float) -> int:
    """A limit with room for `projected` mappings, in whole 65,536s."""
    return (int(projected / HEADROOM) // 65536 + 1) * 65536
