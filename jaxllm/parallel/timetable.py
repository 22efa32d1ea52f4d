"""The timetable of a table-driven pipeline schedule (`config.TABLE_SCHEDULES`):
what each stage does in each step of the loop. In a step a stage runs at most one backward and one
forward, each of one work unit (a microbatch through one of its chunks), and under the split
schedules (`config.SPLIT_SCHEDULES`) at most one weight-gradient pass; then every stage hands its
forward's output to the next stage and its backward's input gradient to the previous one.

Chunk c of stage s is virtual stage v = c·S + s, the pipeline view's [repeats, stages] order; with
one chunk (`1f1b`) a stage is its own virtual stage. Work unit c·M + j is microbatch j's pass
through chunk c. A small list scheduler builds the table from each schedule's order of work: in every step, each
stage back-propagates its next unit if the gradient has arrived and forwards its next unit if the
input has. One forward a step, and a first backward that returns only after the round trip, bound
the units a stage holds in flight (forwarded, not yet back-propagated), whose inputs it keeps:

- `1f1b`: microbatches in order; stage s holds 2(S − s) − 1 units, where GPipe holds all M.
  (Asynchronous 1F1B holds S − s; in lockstep SPMD each hop costs a step both ways.)
- `interleaved_1f1b` (Megatron's order): groups of S microbatches through chunk 0, then chunk 1,
  ...; backwards through the chunks in reverse; (v − 1)·S units more, as Megatron's warm-up, and
  the circular schedule's smaller bubble.
- `zero_bubble` (ZB-H1, "Zero Bubble Pipeline Parallelism"): 1F1B's order, with each backward
  split (`split_backward.py`) into the input gradient, which the previous stage waits for, and
  the weight gradients, which wait in the stage until a step has room for them: where 1F1B's
  stages idle while the last microbatches' gradients travel back, these stages compute the weight
  gradients they put off. A stage puts off fewer than 2S of them, whatever M.
- `interleaved_zero_bubble`: interleaved 1F1B's order with zero-bubble's split backward (PyTorch's
  `ScheduleInterleavedZeroBubble`, which torchtitan runs): interleaving's shorter warm-up and
  cool-down, most of what is left of them filled with put-off weight passes.

The table also assigns every stashed input and every waiting gradient a slot in a small buffer, so
the loop's memory is the most a stage ever holds, not M microbatches.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numpy as np

from jaxllm.config import SPLIT_SCHEDULES, TABLE_SCHEDULES, Schedule

IDLE = -1


class Costs(NamedTuple):
    """A cell's work: a forward, an input gradient, a weight pass (an unsplit backward is both).
    The literature counts each as 1, so 1F1B's backward costs 2; with `jax.checkpoint`'s recompute
    it costs a forward more."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight: float = 1.0


UNIT_COSTS = Costs()


class Timetable(NamedTuple):
    """Each array is [steps, stages]; slots index a stage's buffer of stashed inputs (x) or waiting
    gradients (g), whose last slot (`x_slots`, `g_slots`) is scratch that nothing reads."""

    forward: np.ndarray  # work unit forwarded, or IDLE
    backward: np.ndarray  # work unit back-propagated, or IDLE
    forward_x: np.ndarray  # slot of the forward's input (scratch for virtual stage 0: it reads the batch)
    backward_x: np.ndarray  # slot of the backward's stashed input
    backward_g: np.ndarray  # slot of the backward's output gradient
    received_x: np.ndarray  # slot the activation arriving after this step goes to
    received_g: np.ndarray  # slot the gradient arriving after this step goes to
    loss_g: np.ndarray  # slot for the loss gradient of this step's forward on the last virtual stage
    weight: np.ndarray  # work unit whose weight gradients are computed (split schedules), or IDLE
    forward_r: np.ndarray  # slot the forward's residuals go to (split schedules)
    backward_r: np.ndarray  # slot the backward reads them from
    backward_w: np.ndarray  # slot the backward's taps go to (split schedules)
    weight_w: np.ndarray  # slot the weight pass reads them from
    x_slots: int
    g_slots: int
    r_slots: int
    w_slots: int

    @property
    def steps(self) -> int:
        return self.forward.shape[0]

    @property
    def loss_steps(self) -> np.ndarray:
        """[steps]: where the last virtual stage forwards, and every stage computes its share of the
        loss (`scheduled.py`); the stages' loss work is the same, so it adds no bubble."""
        return self.loss_g[:, -1] != self.g_slots

    @property
    def held(self) -> np.ndarray:
        """The most work units each stage holds in flight at once, [stages]."""
        live = np.cumsum(self.forward != IDLE, axis=0) - np.cumsum(self.backward != IDLE, axis=0)
        return live.max(axis=0)

    @property
    def split(self) -> bool:
        """Whether the weight gradients are computed apart from the backward (`SPLIT_SCHEDULES`)."""
        return bool((self.weight != IDLE).any())

    def work(self, costs: Costs = UNIT_COSTS) -> np.ndarray:
        """[steps, stages]: each stage's work in each step at these `costs`."""
        backward = costs.input_grad if self.split else costs.input_grad + costs.weight
        return (
            costs.forward * (self.forward != IDLE)
            + backward * (self.backward != IDLE)
            + costs.weight * (self.weight != IDLE)
        )

    def bubble(self, costs: Costs = UNIT_COSTS) -> float:
        """The fraction of stage time idle at these `costs`, every step as long as its busiest
        stage's work (the stages meet at every step)."""
        work = self.work(costs)
        return float(1 - work.sum() / (work.shape[1] * work.max(axis=1).sum()))


def work_order(stages: int, microbatches: int, chunks: int) -> tuple[list, list]:
    """The (microbatch, chunk) order of a stage's forwards and of its backwards: groups of S
    microbatches through each chunk in turn (with one chunk, the microbatches in order)."""
    s, v = stages, chunks
    groups = [(k // s, k % s) for k in range(microbatches * v)]  # (group of S microbatches·chunk, index in it)
    forward = [((g // v) * s + i, g % v) for g, i in groups]
    backward = [((g // v) * s + i, v - 1 - g % v) for g, i in groups]
    return forward, backward


def of(schedule: Schedule) -> Timetable:
    """The timetable of a pipeline `schedule` of a table-driven kind."""
    return build(schedule.kind, schedule.stages, schedule.microbatches, schedule.repeats)


def bubble_of(schedule: Schedule) -> float:
    """The schedule's bubble: its table's under a split schedule (lockstep ZB-H1 has no closed
    form), else the stated one (`Schedule.bubble`, which the 1F1B tables equal)."""
    return of(schedule).bubble() if schedule.split else schedule.bubble


def steps_of(schedule: Schedule | None) -> int | None:
    """The steps of a table-driven schedule's loop; None for GPipe, circular or no pipeline."""
    return of(schedule).steps if schedule is not None and schedule.kind in TABLE_SCHEDULES else None


@cache
def build(kind: str, stages: int, microbatches: int, chunks: int) -> Timetable:
    """The timetable of `kind` (one of `config.TABLE_SCHEDULES`) for S stages, M microbatches and v chunks."""
    s_, m, v = stages, microbatches, chunks
    last = v * s_ - 1
    forward_order, backward_order = work_order(s_, m, v)
    forwarded, backpropagated = {}, {}  # (virtual stage, microbatch) -> step
    next_f, next_b = [0] * s_, [0] * s_
    assert kind in TABLE_SCHEDULES, kind
    split = kind in SPLIT_SCHEDULES
    put_off = [[] for _ in range(s_)]  # units whose weight gradients wait, oldest first
    rows, weights = [], []
    step = 0
    while any(n < len(backward_order) for n in next_b) or any(put_off):
        row = []
        for s in range(s_):
            f = b = IDLE
            if next_b[s] < len(backward_order):
                j, c = backward_order[next_b[s]]
                vs = c * s_ + s
                after = forwarded.get((vs, j)) if vs == last else backpropagated.get((vs + 1, j))
                if after is not None and after < step:
                    b, next_b[s] = c * m + j, next_b[s] + 1
            if next_f[s] < len(forward_order):
                j, c = forward_order[next_f[s]]
                vs = c * s_ + s
                if vs == 0 or forwarded.get((vs - 1, j), step) < step:
                    f, next_f[s] = c * m + j, next_f[s] + 1
            row.append((f, b))
        # A put-off weight pass runs where the step's busiest stage leaves its stage room; and
        # where every stage can fill a longer step with one, the step takes them all (no stage
        # idles for it). The rest wait, for the warm-up's and cool-down's short steps.
        cost = [(f != IDLE) + (b != IDLE) for f, b in row]
        level = max(*cost, 1)
        if all(c + bool(p) > level for c, p in zip(cost, put_off, strict=True)):
            level += 1
        weight = [put_off[s].pop(0) if put_off[s] and cost[s] < level else IDLE for s in range(s_)]
        for s, (_, b) in enumerate(row):
            if split and b != IDLE:
                put_off[s].append(b)
        weights.append(weight)
        for s, (f, b) in enumerate(row):  # what ran in this step is visible from the next
            if f != IDLE:
                forwarded[((f // m) * s_ + s, f % m)] = step
            if b != IDLE:
                backpropagated[((b // m) * s_ + s, b % m)] = step
        rows.append(row)
        step += 1
        if step > 4 * (m * v + v * s_) + 8:
            raise RuntimeError(f"the {kind} timetable for S={s_}, M={m}, v={v} does not finish")
    units = np.array(rows)  # [steps, stages, 2]
    return _with_slots(units[..., 0], units[..., 1], np.array(weights), s_, m, v)


def _held_slots(stored: np.ndarray, read: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Slots for values a stage keeps from the step a unit is in `stored` until the step it is in
    `read` ([steps, stages] units or IDLE); a slot read in a step is free to store into in that
    step (the loop writes what a step stores at the start of the next). (store slots, read slots,
    slots), unused entries the scratch slot."""
    store, load = np.full(stored.shape, -1, np.int32), np.full(read.shape, -1, np.int32)
    used = 0
    for s in range(stored.shape[1]):
        free, slot_of, count = [], {}, 0
        for t in range(stored.shape[0]):
            if int(read[t, s]) in slot_of:
                load[t, s] = slot_of.pop(int(read[t, s]))
                free.append(load[t, s])
            if stored[t, s] != IDLE:
                if free:
                    slot = min(free)
                    free.remove(slot)
                else:
                    slot, count = count, count + 1
                store[t, s] = slot_of[int(stored[t, s])] = slot
        used = max(used, count)
    store[store < 0], load[load < 0] = used, used
    return store, load, used


def _with_slots(forward: np.ndarray, backward: np.ndarray, weight: np.ndarray, s_: int, m: int, v: int) -> Timetable:
    """Buffer slots for the table: an input is stashed from its arrival until its backward, a
    gradient waits from its arrival (or, on the last virtual stage, its loss) until its backward."""
    steps, last = forward.shape[0], v * s_ - 1
    sent_x, sent_g = {}, {}  # (stage, unit) -> step after which it arrives
    for t in range(steps):
        for s in range(s_):
            f, b = forward[t, s], backward[t, s]
            if f != IDLE:
                c, j = divmod(f, m)
                vs = c * s_ + s
                if vs < last:
                    nxt = vs + 1
                    sent_x[(nxt % s_, (nxt // s_) * m + j)] = t
                else:
                    sent_g[(s, f)] = t  # its own loss's gradient
            if b != IDLE:
                c, j = divmod(b, m)
                vs = c * s_ + s
                if vs > 0:
                    prev = vs - 1
                    sent_g[(prev % s_, (prev // s_) * m + j)] = t
    x_of, g_of = {}, {}  # (stage, unit) -> slot
    tables = {name: np.full((steps, s_), -1, np.int32) for name in
              ("forward_x", "backward_x", "backward_g", "received_x", "received_g", "loss_g")}  # fmt: skip
    x_used, g_used = [0] * s_, [0] * s_
    free_x, free_g = [set() for _ in range(s_)], [set() for _ in range(s_)]

    def take(free, used, s):
        if free[s]:
            slot = min(free[s])
            free[s].discard(slot)
            return slot
        used[s] += 1
        return used[s] - 1

    for t in range(steps):
        for s in range(s_):
            f, b = forward[t, s], backward[t, s]
            if f != IDLE:
                tables["forward_x"][t, s] = x_of.get((s, f), -1)
            if b != IDLE:
                tables["backward_x"][t, s] = x_of.get((s, b), -1)
                tables["backward_g"][t, s] = g_of.pop((s, b))
                free_g[s].add(tables["backward_g"][t, s])
                if (s, b) in x_of:
                    free_x[s].add(x_of.pop((s, b)))
        # Arrivals after step t, into slots freed by this step's reads.
        for (s, unit), when in sent_x.items():
            if when == t:
                x_of[(s, unit)] = tables["received_x"][t, s] = take(free_x, x_used, s)
        for (s, unit), when in sent_g.items():
            if when == t:
                slot = g_of[(s, unit)] = take(free_g, g_used, s)
                own = forward[t, s] == unit
                tables["loss_g" if own else "received_g"][t, s] = slot
    x_slots, g_slots = max(x_used), max(g_used)
    for name, table in tables.items():  # unused: the scratch slot
        table[table < 0] = g_slots if name in ("backward_g", "received_g", "loss_g") else x_slots
    split = (weight != IDLE).any()
    # Split backwards: a forward's residuals wait for its backward, the backward's taps for its weight pass.
    forward_r, backward_r, r_slots = _held_slots(forward if split else np.full_like(forward, IDLE), backward)
    backward_w, weight_w, w_slots = _held_slots(backward if split else np.full_like(backward, IDLE), weight)
    return Timetable(
        forward, backward, **tables, weight=weight, forward_r=forward_r, backward_r=backward_r,
        backward_w=backward_w, weight_w=weight_w, x_slots=x_slots, g_slots=g_slots, r_slots=r_slots, w_slots=w_slots,
    )  # fmt: skip
