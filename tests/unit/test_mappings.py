"""A server's start-up stops, naming the fix, where its programs would pass the kernel's limit on a
process's memory mappings (`serve/mappings.py`): real XLA:CPU programs, the kernel's real count."""

import re

import jax
import jax.numpy as jnp
import pytest

from jaxllm.serve.mappings import (
    ESTIMATED_FROM,
    HEADROOM,
    MappingBudget,
    MappingLimitError,
    kernel_limit,
    mappings,
    projection,
)

on_linux = pytest.mark.skipif(mappings() is None or kernel_limit() is None, reason="needs Linux's /proc")


def _programs(n: int, budget: MappingBudget, total: int, kept: list | None = None) -> list:
    """`n` distinct programs compiled and kept in `kept` (a dropped one unmaps its code), each
    reported to `budget`."""
    kept = [] if kept is None else kept
    for i in range(n):
        kept.append(jax.jit(lambda x, i=i: jnp.sin(x * (i + 2)) + i).lower(jnp.ones(8)).compile())
        budget(i + 1, total)
    return kept


def test_the_projection_is_each_programs_mappings_since_the_baseline_times_the_programs_to_come():
    assert projection((1, 1000), (8, 1700), 108) == (100.0, 1700 + 100 * 100)
    assert projection((8, 1700), (16, 2100), 20) == (50.0, 2100 + 50 * 4)
    assert projection((1, 1000), (8, 900), 108) == (0.0, 900)  # memory let go meanwhile: nothing projected


@on_linux
def test_each_compiled_program_maps_memory_regions():
    before = mappings()
    kept = _programs(4, MappingBudget(), 4)
    assert mappings() >= before + 4, "XLA:CPU no longer maps a program's code apart: the budget guards nothing"
    del kept


@on_linux
def test_a_start_up_within_the_limit_goes_on_reports_its_progress_and_what_it_holds_of_the_kernels_limit():
    heard = []
    budget = MappingBudget(lambda done, total: heard.append((done, total)))
    kept = _programs(ESTIMATED_FROM + 1, budget, ESTIMATED_FROM + 1)
    assert heard == [(n, ESTIMATED_FROM + 1) for n in range(1, ESTIMATED_FROM + 2)]
    held, limit = re.fullmatch(r"; the process holds ([\d,]+) memory mappings of the ([\d,]+) the kernel allows",
                               budget.summary()).groups()  # fmt: skip
    assert int(limit.replace(",", "")) == kernel_limit() and int(held.replace(",", "")) > 0
    del kept


@on_linux
def test_a_start_up_whose_programs_would_pass_the_limit_stops_once_it_can_estimate_them():
    kept = []
    with pytest.raises(MappingLimitError) as stopped:
        _programs(ESTIMATED_FROM + 4, MappingBudget(limit=int((mappings() + 50_000) / HEADROOM)), 100_000, kept)
    assert len(kept) == ESTIMATED_FROM
    message = str(stopped.value)
    assert "100000 programs" in message and "vm.max_map_count" in message and "serve.max_len" in message
    suggested = int(message.split("vm.max_map_count=")[1].split(")")[0])
    assert suggested * HEADROOM > float(message.split("hold about ")[1].split(" ")[0].replace(",", ""))


@on_linux
def test_the_limit_counts_what_the_process_already_holds():
    """More programs fit a limit well above the process's mappings, and not one just above them."""
    now = mappings()
    kept = _programs(ESTIMATED_FROM, MappingBudget(limit=int((now + 100_000) / HEADROOM)), 30)
    with pytest.raises(MappingLimitError):
        _programs(ESTIMATED_FROM, MappingBudget(limit=int((mappings() + 50) / HEADROOM)), 30, kept)
    del kept
