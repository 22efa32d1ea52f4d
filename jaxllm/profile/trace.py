"""A step's device time, read from the trace that `jax.profiler` writes (`*.trace.json.gz`, the
Chrome/Perfetto trace JSON that TensorBoard's profile plugin also reads).

Every device op in that trace is one complete event (`"ph": "X"`) whose args name its HLO op
(`hlo_op`) and module (`hlo_module`); on CPU the device is `args.device_ordinal` (XLA's CPU
backend runs each fake device's ops on host threads), on GPUs the event's process is
`/device:GPU:N`. Ops of one device may overlap (independent thunks run concurrently, and a `while`
or `conditional` spans the ops of its body), so time is split per device into elementary intervals
at every event boundary, and each interval goes to ONE category, the first of `CATEGORIES` that
has an op running then:

    matmul > attention > other (compute) > the collectives by kind > copies and host transfers > idle

so the categories of a device add up to the profiled window exactly, and a collective counts only
where no compute runs: the collective categories are communication NOT hidden behind compute.
Figures are per device, averaged over devices, and per step (the window divided by the steps).
`while`, `conditional` and `call` ops are containers: their body's ops are in the trace, so they
count in no category (see `pipeline_bubble` for how the pipeline's loop is found).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import math
import pathlib
import re
from collections.abc import Iterable, Iterator, Mapping

from jaxllm.config import TABLE_SCHEDULES, Schedule

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
CATEGORIES = ("matmul", "attention", "other", *COLLECTIVES, "copy/transfer", "idle")
CONTAINERS = ("while", "conditional", "call")
COMPUTE = ("matmul", "attention", "other", "copy/transfer")  # what a device works on, not waits in

# How each kind of op is named: XLA's opcode (`all-reduce.3`, `all-reduce-start`), or the JAX
# primitive that emitted it (`psum_invariant.2`, `ppermute.16`: JAX names HLO ops after their source).
_COLLECTIVE_NAMES = (
    ("reduce-scatter", r"reduce[-_]scatter|psum_scatter"),  # before all-reduce: psum_scatter starts with psum
    ("all-reduce", r"all[-_]reduce|^psum|^pmax|^pmin|^pmean"),
    ("all-gather", r"all[-_]gather"),
    ("all-to-all", r"all[-_]to[-_]all"),
    ("collective-permute", r"collective[-_]permute|ppermute|^send|^recv"),
)
_MATMUL = r"^dot|_dot|dot_|gemm|matmul|cublas|convolution|^conv|ynn_fusion"  # ynn_fusion: XLA CPU's YNNPACK dots
_ATTENTION = r"attention|fmha|flash|softmax|splash|mha"
_COPY = r"^copy|^wrapped_copy|memcpy|host[-_]to[-_]device|device[-_]to[-_]host|transfer|offload"
_LONG_OPCODE = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start|-done)?\(")


def categorize(name: str, long_name: str = "") -> str:
    """The category of an HLO op from its name (and its full HLO text where the trace has it, as
    GPU traces do in `args.long_name`)."""
    if (m := _LONG_OPCODE.search(long_name)) is not None:
        return m.group(1)
    base = re.sub(r"\.\d+$", "", name.lower())
    for kind, pattern in _COLLECTIVE_NAMES:
        if re.search(pattern, base):
            return kind
    for kind, pattern in (("matmul", _MATMUL), ("attention", _ATTENTION), ("copy/transfer", _COPY)):
        if re.search(pattern, base):
            return kind
    return "other"


def is_container(name: str) -> bool:
    return re.sub(r"\.\d+$", "", name.lower()) in CONTAINERS


@dataclasses.dataclass(frozen=True)
class Op:
    """One device op of the trace, times in microseconds."""

    device: str
    name: str
    start: float
    end: float
    category: str
    run: str = ""  # the execution it belongs to (args.run_id), where the trace says

    @property
    def container(self) -> bool:
        return is_container(self.name)


def find_trace(logdir: str | pathlib.Path) -> pathlib.Path:
    """The newest `*.trace.json.gz` under `logdir` (jax.profiler writes plugins/profile/<run>/)."""
    found = sorted(pathlib.Path(logdir).glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {logdir}/plugins/profile/; was a trace captured there?")
    return found[-1]


def read_ops(path: str | pathlib.Path, module: str | None = None) -> list[Op]:
    """The device ops of a trace file (of HLO module `module` only, if given)."""
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = []
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or (module is not None and args.get("hlo_module") != module):
            continue
        device = args.get("device_ordinal")
        if device is None:  # GPU/TPU traces: one process per device
            m = re.search(r"/device:[A-Z]+:(\d+)", process.get(e["pid"], ""))
            device = m.group(1) if m else str(e["pid"])
        name = args["hlo_op"]
        start = float(e["ts"])
        ops.append(Op(str(device), name, start, start + float(e.get("dur", 0.0)),
                      categorize(name, args.get("long_name", "")), str(args.get("run_id", ""))))  # fmt: skip
    return ops


def partition(ops: Iterable[Op], start: float, end: float) -> dict[str, float]:
    """The microseconds of [start, end) in each category for one device's ops (see the module's
    docstring for the order that decides an interval where ops of several categories overlap)."""
    rank = {c: i for i, c in enumerate(CATEGORIES)}
    edges = []
    for op in ops:
        if op.container or op.end <= start or op.start >= end:
            continue
        edges += [(max(op.start, start), 1, rank[op.category]), (min(op.end, end), -1, rank[op.category])]
    edges.sort(key=lambda x: (x[0], x[1]))
    totals = dict.fromkeys(CATEGORIES, 0.0)
    running = collections.Counter()
    at = start
    for t, delta, r in edges:
        if t > at:
            active = [c for c, n in running.items() if n > 0]
            totals[CATEGORIES[min(active)] if active else "idle"] += t - at
            at = t
        running[r] += delta
    totals["idle"] += max(end - at, 0.0)
    return totals


@dataclasses.dataclass
class Summary:
    """A profiled window's device time per step (seconds, averaged over devices)."""

    steps: int
    step_time: float
    categories: dict[str, float]  # seconds per step; they add up to step_time
    top_ops: list[tuple[str, str, float, float]]  # (op, category, seconds per step, share of the step)
    comm_share: float  # exposed collective time / step time
    bubble: float | None = None  # see pipeline_bubble; None without a pipeline
    pipeline_share: float | None = None  # the pipeline loops' share of the step
    # A timetable-driven pipeline's measured work per loop step and stage, seconds [steps][stages]
    stage_work: list[list[float]] | None = None
    devices: int = 0

    def metrics(self) -> dict[str, float]:
        """The scalars a metrics log keeps."""
        out = {"profile_step_time_s": self.step_time, "comm_share": self.comm_share}
        out |= {f"profile_{c.replace('/', '_').replace('-', '_')}_s": t for c, t in self.categories.items()}
        if self.bubble is not None:
            out["bubble_measured"] = self.bubble
        return out

    def format(self) -> str:
        lines = [f"profile: {self.steps} steps on {self.devices} devices, {self.step_time * 1e3:.2f} ms a step"]
        lines.append("  device time by category (per step, mean over devices; exposed time only):")
        for c, t in self.categories.items():
            lines.append(f"    {c:<20} {t * 1e3:10.3f} ms  {t / self.step_time:6.1%}")
        lines.append(f"  top {len(self.top_ops)} ops (time per step per device, share of the step):")
        for name, c, t, share in self.top_ops:
            lines.append(f"    {name:<44} {c:<19} {t * 1e3:10.3f} ms  {share:6.1%}")
        lines.append(f"  communication share (collectives not hidden behind compute): {self.comm_share:.1%}")
        if self.bubble is not None:
            lines.append(f"  pipeline bubble (measured): {self.bubble:.1%} of the pipeline loops, which take "
                         f"{self.pipeline_share:.1%} of the step")  # fmt: skip
        return "\n".join(lines)


def summarize(ops: list[Op], steps: int, *, schedule: Schedule | None = None,
              stage_of: Mapping[str, int] | None = None, loop_steps: int | None = None,
              top: int = 15) -> Summary:  # fmt: skip
    """The summary of `steps` steps' device ops. With a pipeline `schedule` and each device's stage
    (`stage_of`, by device key), also the measured bubble; a timetable-driven schedule needs its
    loop's steps too (`loop_steps`, `parallel.timetable.steps_of`)."""
    if not ops:
        raise ValueError("the trace holds no device ops (args.hlo_op); was a step run while tracing?")
    by_device = collections.defaultdict(list)
    for op in ops:
        by_device[op.device].append(op)
    start, end = min(o.start for o in ops), max(o.end for o in ops)
    n = len(by_device)
    window = (end - start) * 1e-6
    step_time = window / steps
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for device_ops in by_device.values():
        for c, t in partition(device_ops, start, end).items():
            totals[c] += t * 1e-6 / n / steps
    per_op = collections.Counter()
    category = {}
    for op in ops:
        if not op.container:
            per_op[op.name] += (op.end - op.start) * 1e-6 / n / steps
            category[op.name] = op.category
    top_ops = [(name, category[name], t, t / step_time) for name, t in per_op.most_common(top)]
    comm = sum(totals[c] for c in COLLECTIVES) / step_time
    summary = Summary(steps, step_time, totals, top_ops, comm, devices=n)
    if schedule is not None and stage_of:
        if schedule.kind not in TABLE_SCHEDULES:
            summary.bubble, summary.pipeline_share = pipeline_bubble(by_device, schedule, stage_of, window * 1e6)
        elif loop_steps:
            summary.bubble, summary.pipeline_share, summary.stage_work = timetable_bubble(
                by_device, loop_steps, stage_of, window * 1e6
            )
    return summary


def empty_iterations(stage: int, schedule: Schedule, backward: bool) -> set[int]:
    """The iterations of the pipeline's scan in which `stage` holds no microbatch: iteration k of
    stage s works on a real microbatch for s <= k < s + repeats·microbatches; the backward scan
    runs the iterations in reverse."""
    stages, repeats, micro = schedule.stages, schedule.repeats, schedule.microbatches
    n = repeats * micro + stages - 1
    empty = {k for k in range(n) if k < stage or k >= stage + repeats * micro}
    return {n - 1 - k for k in empty} if backward else empty


def _pipeline_loops(ops: list[Op], n: int) -> Iterator[tuple[tuple, bool, list[float]]]:
    """One device's pipeline loops: for each, its key (execution, permute op, which loop of that
    op's runs), whether it is a backward loop, and its n + 1 iteration boundaries (see
    `pipeline_bubble`)."""
    whiles = sorted(o.start for o in ops if o.name.lower().startswith("while"))
    shifts = collections.defaultdict(list)  # (execution, permute op) -> its runs
    for o in ops:
        if o.category == "collective-permute":
            shifts[o.run, o.name].append(o)
    order: collections.Counter = collections.Counter()
    for (run, name), runs in sorted(shifts.items(), key=lambda kv: min(o.start for o in kv[1])):
        if len(runs) % n:
            continue
        runs.sort(key=lambda o: o.start)
        backward = order[run] % 2 == 1
        order[run] += 1
        for c in range(0, len(runs), n):
            loop = runs[c : c + n]
            before = [t for t in whiles if t <= loop[0].start]
            begin = max(before[-1] if before else loop[0].start, runs[c - 1].end if c else -math.inf)
            yield (run, name, c), backward, [begin] + [o.end for o in loop]


def pipeline_bubble(by_device: Mapping[str, list[Op]], schedule: Schedule, stage_of: Mapping[str, int],
                    window_us: float) -> tuple[float | None, float | None]:  # fmt: skip
    """The measured bubble of GPipe or circular, by the formula `timetable_bubble` applies to a
    timetable's steps; and the pipeline loops' share of the step.

    The pipeline is a `lax.scan` of n = `repeats·microbatches + stages − 1` iterations (its
    gradient is a second one), each ending with the `ppermute` that shifts activations to the next
    stage. In one execution of the step, a collective-permute op that runs a multiple of n times is
    a pipeline shift; each n consecutive runs of it are one loop, whose iteration i lasts from the
    end of shift i − 1 to the end of shift i (iteration 0 from the start of the `while` op that
    holds it: XLA's CPU backend ends a while's event before its body's, so only its start is
    used). The permute ops of one execution alternate forward, backward, in the order they first
    run. A stage's work w[i, s] in iteration i is its compute there, the least over its devices
    and the profiled executions (fake CPU devices that share a few cores wait for them). Every
    stage waits at a shift for the busiest, and computes in every iteration of an SPMD scan, on
    zeros where it holds no microbatch (`empty_iterations`), so

        bubble = 1 − Σ_{s holds a microbatch in i} w[i, s] / (S · Σ_i max_s w[i, s])

    which on evenly costly iterations is the analytic (stages − 1)/n."""
    stages, repeats, micro = schedule.stages, schedule.repeats, schedule.microbatches
    n = repeats * micro + stages - 1
    work = collections.defaultdict(list)  # (backward, loop's first run of its shift, iteration, stage) -> samples
    shares = []
    for device, ops in by_device.items():
        if device not in stage_of:
            continue
        leaves = [o for o in ops if not o.container]
        total = 0.0
        for key, backward, cuts in _pipeline_loops(ops, n):
            for i in range(n):
                part = partition(leaves, cuts[i], cuts[i + 1])
                work[backward, key[2], i, stage_of[device]].append(sum(part[k] for k in COMPUTE))
            total += cuts[-1] - cuts[0]
        if total > 0:
            shares.append(total / window_us)
    iterations = {k[:3] for k in work}
    if not shares or len(work) != stages * len(iterations):
        return None, None

    def held(key: tuple) -> bool:
        backward, _, i, stage = key
        return i not in empty_iterations(stage, schedule, backward)

    return _lockstep_bubble(work, stages, held), sum(shares) / len(shares)


def _lockstep_bubble(work: Mapping[tuple, list[float]], stages: int, useful=lambda key: True) -> float:
    """`1 − Σ useful w / (S · Σ_steps max_s w)` for `work` samples keyed (*step, stage), w a
    cell's least sample: every stage waits at a step's shifts for the busiest."""
    w = {key: min(samples) for key, samples in work.items()}
    steps = {key[:-1] for key in w}
    lockstep = sum(max(w[(*step, s)] for s in range(stages)) for step in steps)
    return 1 - sum(t for key, t in w.items() if useful(key)) / (stages * lockstep)


def timetable_bubble(by_device: Mapping[str, list[Op]], steps: int, stage_of: Mapping[str, int],
                     window_us: float) -> tuple[float | None, float | None, list | None]:  # fmt: skip
    """The measured bubble of a timetable-driven schedule (`config.TABLE_SCHEDULES`), its loop's
    share of the profiled window, and each stage's work in each step (seconds, [steps][stages]).

    Its loop is one `lax.scan` of `steps` steps, each ending with two collective-permutes
    (activations on, gradients back) that run `steps` times per loop, a loop per accumulation
    microstep. Step i on a device lasts from the end of step i − 1's later permute to the end of
    its own (step 0 from the start of the `while` that holds the loop, or the end of the loop
    before); its work w[i, s] is the compute in it (every category but the collectives and idle:
    the stage's forward, its backward, the buffer updates). Every stage waits at a step's permutes
    for the busiest, so

        bubble = 1 − Σ w / (S · Σ_i max_s w[i, s])

    `Timetable.bubble`'s formula with measured costs in place of the unit ones. w[i, s] is the least
    over the stage's devices and the profiled executions: on fake CPU devices that share a few
    cores, a sample grows whenever its thread waits for a core."""
    work = collections.defaultdict(list)  # (step, stage) -> samples
    shares = []
    for device, ops in by_device.items():
        if device not in stage_of:
            continue
        shifts = collections.defaultdict(list)  # (execution, permute op) -> its runs
        for o in ops:
            if o.category == "collective-permute":
                shifts[o.run, o.name].append(o)
        whiles = sorted(o.start for o in ops if o.name.lower().startswith("while"))
        leaves = [o for o in ops if not o.container]
        loop_time = 0.0
        for run in sorted({run for run, _ in shifts}):
            pair = [sorted(runs, key=lambda o: o.start)
                    for (r, _), runs in shifts.items() if r == run and len(runs) % steps == 0]  # fmt: skip
            if len(pair) != 2 or len(pair[0]) != len(pair[1]):
                continue
            for c in range(0, len(pair[0]), steps):  # one loop per accumulation microstep
                ends = [max(shift[c + i].end for shift in pair) for i in range(steps)]
                first = min(shift[c].start for shift in pair)
                begin = max([t for t in whiles if t <= first], default=first)
                if c:
                    begin = max(begin, *(shift[c - 1].end for shift in pair))
                cuts = [begin, *ends]
                for i in range(steps):
                    part = partition(leaves, cuts[i], cuts[i + 1])
                    work[i, stage_of[device]].append(sum(part[k] for k in COMPUTE))
                loop_time += cuts[-1] - cuts[0]
        if loop_time:
            shares.append(loop_time / window_us)
    stages = len(set(stage_of.values()))
    if not shares or len(work) != steps * stages:
        return None, None, None
    w = [[min(work[i, s]) * 1e-6 for s in range(stages)] for i in range(steps)]
    return _lockstep_bubble(work, stages), sum(shares) / len(shares), w
