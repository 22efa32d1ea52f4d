"""Where a run's wall-clock time went, across restarts and requeues: each process 0 (of a training
attempt, or of a data-preparation step) appends to `WORKDIR/goodput.jsonl` a line each time a span
of its time ends, saying what the span was. The spans of an attempt tile it from the process's own
start (read from the kernel, so interpreter start and imports count) to its last line; the time
between one attempt's last line and the next one's start is waiting (failure detection, backoff,
requeue, the queue). Steps that a later attempt computes again, because it resumed from an older
checkpoint, are lost work. Goodput is productive step time over the wall time of the whole run.

    python -m jaxllm.train --goodput WORKDIR      # the table
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections import defaultdict

LEDGER = "goodput.jsonl"
# The account's rows, in the order printed; what each span of a process counts as.
CATEGORIES = {
    "productive": "training steps whose results were kept",
    "startup": "process start and exit, imports, distributed init, building the run, the first step's compilation",
    "data": "tokenizer training and data preparation",
    "restore": "reading the checkpoint a run resumed from",
    "save": "the blocking part of checkpoint saves (and waiting for the last ones at the end)",
    "evaluate": "validation losses and the end-of-training sample",
    "lost": "steps computed again after a failure (their first computation)",
    "waiting": "between attempts: detecting a failure, backoff, requeue and the queue",
}


def process_start_time() -> float:
    """When this process started, in `time.time()` seconds: from /proc where there is one (to 10 ms),
    else now."""
    try:
        fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return time.time()


class Ledger:
    """Appends this process's spans to the workdir's ledger. Only process 0 of a job writes: set
    `active` once that is known (after distributed start-up); nothing is written before the first
    mark, so the process's own start still opens its first span."""

    def __init__(self, workdir: str | pathlib.Path, active: bool = True):
        self.active, self.path = active, pathlib.Path(workdir) / LEDGER
        self.last = process_start_time()
        self.attempt = f"{os.environ.get('SLURM_JOB_ID', 'local')}:{os.getpid()}:{self.last:.3f}"
        self._started = False

    def mark(self, what: str, **fields) -> None:
        """The span since the last mark was `what` (a category, 'step' with its step, or 'restore' with
        the step resumed from)."""
        if not self._started:
            self._write({"what": "start", "t": self.last})
            self._started = True
        self.last = time.time()
        self._write({"what": what, "t": self.last, **fields})

    def _write(self, line: dict) -> None:
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:  # one write a line: a killed process leaves whole lines
            f.write(json.dumps({"attempt": self.attempt, **line}) + "\n")


def _attempts(path: pathlib.Path) -> list[list[dict]]:
    by_attempt: dict[str, list[dict]] = defaultdict(list)
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue  # cut short by a killed process
        by_attempt[line["attempt"]].append(line)
    return sorted(by_attempt.values(), key=lambda lines: lines[0]["t"])


def account(workdir: str | pathlib.Path) -> dict:
    """{'seconds': {category: s}, 'wall': s, 'goodput': fraction, 'attempts': n, 'lost_steps': n}."""
    path = pathlib.Path(workdir) / LEDGER
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: {workdir} is not the workdir of a training run")
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    kept: dict[int, float] = {}  # step -> seconds of its latest computation
    lost_steps, end = 0, None
    attempts = _attempts(path)
    for lines in attempts:
        if end is not None:
            seconds["waiting"] += max(lines[0]["t"] - end, 0.0)
        end = lines[0]["t"]
        for line in lines[1:]:
            span, end = line["t"] - end, line["t"]
            if line["what"] == "step":
                kept[line["step"]] = span
                continue
            if line["what"] == "restore":
                for step in [s for s in kept if s > line["step"]]:
                    seconds["lost"] += kept.pop(step)
                    lost_steps += 1
            seconds[line["what"]] += span
    seconds["productive"] = sum(kept.values())
    wall = end - attempts[0][0]["t"]
    return {"seconds": seconds, "wall": wall, "goodput": seconds["productive"] / wall if wall > 0 else 0.0,
            "attempts": len(attempts), "lost_steps": lost_steps}  # fmt: skip


def format_account(acct: dict) -> str:
    wall = acct["wall"]
    rows = [f"goodput: {acct['goodput']:.1%} of {wall:.1f} s wall, from {acct['attempts']} process starts"]
    for name, seconds in acct["seconds"].items():
        extra = f"  ({acct['lost_steps']} steps)" if name == "lost" else ""
        rows.append(f"  {name:<11}{seconds:>10.1f} s {seconds / wall if wall else 0:>6.1%}  {CATEGORIES[name]}{extra}")
    return "\n".join(rows)
