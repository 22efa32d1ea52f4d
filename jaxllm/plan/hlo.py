"""Reading compiled HLO text: which computation runs how often, and the collectives in each."""

import re
from collections import defaultdict

_CALLEES = re.compile(r"(?:condition|to_apply|calls|branch_computations)=\{?%([\w.\-]+)")
_LOOP = re.compile(r" while\(.*?body=%([\w.\-]+)(?:.*?\"known_trip_count\":\{\"n\":\"(\d+)\"\})?")


def computations(hlo: str) -> dict[str, str]:
    """Each computation's name and instructions; the entry computation is named 'ENTRY'."""
    comps = {}
    for head, name, body in re.findall(r"^(ENTRY )?%(\S+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M):
        comps["ENTRY" if head else name] = body
    return comps


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
            for callee in _CALLEES.findall(line):
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
            todo += _CALLEES.findall(comps[name]) + [b for b, _ in _LOOP.findall(comps[name])]
    return inside
