"""Reading compiled HLO text: which computation runs how often, the collectives in each, and the
bytes they move per step.

Bytes are counted as the planner counts them (`plan.comm`): the whole array a collective works
on in its group, whatever the algorithm: an all-reduce's or reduce-scatter's input, an
all-gather's output, a collective-permute's array. XLA:CPU expresses a reduce-scatter as an
all-reduce whose result each device slices (a GPU compiler rewrites that pair into a
reduce-scatter); both reduce the same array, so both count as one `reduce` of it.
"""

import math
import re
from collections import defaultdict

_CALLEES = re.compile(r"(?:condition|to_apply|calls)=%([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%([\w.\-]+))")
_LOOP = re.compile(r" while\(.*?body=%([\w.\-]+)(?:.*?\"known_trip_count\":\{\"n\":\"(\d+)\"\})?")
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")

# What each collective does to an array of the group, and which of its arrays that is.
KINDS = {
    "all-reduce": "reduce",
    "reduce-scatter": "reduce",
    "all-gather": "gather",
    "collective-permute": "permute",
    "all-to-all": "all-to-all",
}


def computations(hlo: str) -> dict[str, str]:
    """Each computation's name and instructions; the entry computation is named 'ENTRY'."""
    comps = {}
    for head, name, body in re.findall(r"^(ENTRY )?%(\S+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M):
        comps["ENTRY" if head else name] = body
    return comps


def _callees(line: str) -> list[str]:
    """Computations an instruction calls once per run (a conditional's branches all count: the
    planner's step is one that applies its update)."""
    names = _CALLEES.findall(line)
    for listed, single in _BRANCHES.findall(line):
        names += re.findall(r"%([\w.\-]+)", listed) if listed else [single]
    return names


def executions(hlo: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry: the product of the trip counts
    of the while loops around it (a loop without a known trip count fails the reading)."""
    comps, runs = computations(hlo), defaultdict(int)

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for line in comps[name].splitlines():
            for body, trips in _LOOP.findall(line):
                assert trips, f"while loop without a known trip count: {line[:200]}"
                visit(body, times * int(trips))
            for callee in _callees(line):
                visit(callee, times)

    visit("ENTRY", 1)
    return dict(runs)


def ops(hlo: str, op: str) -> list[tuple[str, str]]:
    """(computation, instruction line) of every `op` instruction (async starts included)."""
    pattern = re.compile(rf"= .*? {op}(?:-start)?\(")
    comps = computations(hlo).items()
    return [(name, line) for name, body in comps for line in body.splitlines() if pattern.search(line)]


def loop_bodies(hlo: str) -> set[str]:
    """Every computation that runs inside some while loop."""
    comps = computations(hlo)
    inside, todo = set(), [b for body in comps.values() for b, _ in _LOOP.findall(body)]
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo += _callees(comps[name]) + [b for b, _ in _LOOP.findall(comps[name])]
    return inside


_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}


def array_bytes(text: str) -> int:
    """Bytes of every array type written in `text` (`f32[8,128]{1,0}`, a tuple of them, ...)."""
    return sum(_ITEMSIZE[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(text))


def group_size(line: str) -> int:
    """Devices in each group of a collective (a permute's pairs count as groups of 2, or 1 when
    every device sends to itself)."""
    if match := re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", match.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", match.group(2)))
    if match := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
        return int(match.group(1))
    if match := re.search(r"replica_groups=\{\{([\d,]+)\}", line):
        return len(match.group(1).split(","))
    if match := re.search(r"source_target_pairs=\{(.*?)\}\}", line):
        return 1 if all(a == b for a, b in re.findall(r"(\d+),(\d+)", match.group(1))) else 2
    raise ValueError(f"unreadable replica groups: {line[:300]}")


def collective_bytes(hlo: str) -> dict[str, float]:
    """Bytes per device per call of the entry by kind (`KINDS`), counted as the module's doc says,
    each collective times the runs of the computation it is in; a group of one device moves
    nothing. (Synchronous collectives, as XLA:CPU compiles them.)"""
    runs, out = executions(hlo), defaultdict(float)
    for op, kind in KINDS.items():
        pattern = re.compile(rf"= (.*?) {op}\(")
        for comp, body in computations(hlo).items():
            for line in body.splitlines():
                if (match := pattern.search(line)) and (n := group_size(line)) > 1:
                    size = array_bytes(match.group(1)) * (n if op == "reduce-scatter" else 1)
                    out[kind] += runs.get(comp, 0) * size
    return dict(out)
