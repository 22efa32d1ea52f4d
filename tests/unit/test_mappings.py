"""A server's start-up stops, naming the fix, where its programs would pass the kernel's limit on a
process's memory mappings (`serve/mappings.py`): real XLA:CPU programs, the kernel's real count."""

import jax
import jax.numpy as jnp
import pytest

from jaxllm.serve.mappings import ESTIMATED_FROM, HEADROOM, MappingBudget, MappingLimitError, kernel_limit, mappings

pytestmark = pytest.mark.skipif(mappings() is None or kernel_limit() is None, reason="needs Linux's /proc")


def _programs(n: int, budget: MappingBudget, total: int, kept: list | None = None) -> list:
    """`n` distinct programs compiled and kept in `kept` (a dropped one unmaps its code), each
    reported to `budget`."""
    kept = [] if kept is None else kept
    for i in range(n):
        kept.append(jax.jit(lambda x, i=i: jnp.sin(x * (i + 2)) + i).lower(jnp.ones(8)).compile())
        budget(i + 1, total)
    return kept


def test_each_compiled_program_maps_memory_regions():
    before = mappings()
    kept = _programs(4, MappingBudget(), 4)
    assert mappings() >= before + 4 * 10, "XLA:CPU no longer maps a program's code apart: the budget guards nothing"
    del kept


def test_a_start_up_within_the_limit_goes_on_and_reports_its_progress():
    heard = []
    kept = _programs(4, MappingBudget(lambda done, total: heard.append((done, total))), 4)
    assert heard == [(1, 4), (2, 4), (3, 4), (4, 4)]
    del kept


def test_a_start_up_whose_programs_would_pass_the_kernels_limit_stops_once_it_can_estimate_them():
    kept = []
    with pytest.raises(MappingLimitError) as stopped:
        _programs(ESTIMATED_FROM + 4, MappingBudget(), 100_000, kept)
    assert len(kept) == ESTIMATED_FROM
    message = str(stopped.value)
    assert "100000 programs" in message and "vm.max_map_count" in message and "serve.max_len" in message
    suggested = int(message.split("vm.max_map_count=")[1].split(")")[0])
    assert suggested * HEADROOM > float(message.split("hold about ")[1].split(" ")[0].replace(",", ""))


def test_the_limit_counts_what_the_process_already_holds():
    """A few programs more fit a limit well above the process's mappings, and not one just above them."""
    now = mappings()
    kept = _programs(ESTIMATED_FROM, MappingBudget(limit=int((now + 100_000) / HEADROOM)), 30)
    with pytest.raises(MappingLimitError):
        _programs(ESTIMATED_FROM, MappingBudget(limit=int((mappings() + 50) / HEADROOM)), 30, kept)
    del kept
