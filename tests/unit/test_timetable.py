"""The timetables of 1F1B, interleaved 1F1B and both zero-bubbles, replayed step by step: every unit
once, in an order its data allows, its buffers never overwritten while live, its memory bounded by
the stages rather than the microbatches, and its bubble the one the planner states."""

import pytest

from jaxllm.config import SPLIT_SCHEDULES, Schedule
from jaxllm.parallel.timetable import IDLE, Costs, build

CASES = [(kind, s, m, 1) for kind in ("1f1b", "zero_bubble") for s in (2, 4) for m in (s, 2 * s, 4 * s)] + [
    (kind, s, m, v)
    for kind in ("interleaved_1f1b", "interleaved_zero_bubble")
    for s in (2, 4)
    for m in (s, 2 * s, 4 * s)
    for v in (2, 3)
]
SPLIT_CASES = [c for c in CASES if c[0] in SPLIT_SCHEDULES]


def _virtual(unit, stage, stages, microbatches):
    """(virtual stage, microbatch) of a stage's work unit."""
    return (unit // microbatches) * stages + stage, unit % microbatches


@pytest.mark.parametrize("kind, stages, microbatches, chunks", CASES)
def test_every_unit_runs_once_after_what_it_needs(kind, stages, microbatches, chunks):
    """Each (virtual stage, microbatch) is forwarded and back-propagated exactly once; a forward
    follows the previous virtual stage's forward, a backward the next one's backward (the last
    virtual stage's, its own forward), each in an earlier step: what a step sends arrives after it."""
    table = build(kind, stages, microbatches, chunks)
    last = stages * chunks - 1
    forwarded, backpropagated = {}, {}
    for t in range(table.steps):
        for s in range(stages):
            if (f := table.forward[t, s]) != IDLE:
                vs, j = _virtual(f, s, stages, microbatches)
                assert (vs, j) not in forwarded
                assert vs == 0 or forwarded[(vs - 1, j)] < t, f"F{j} on virtual stage {vs} before its input"
                forwarded[(vs, j)] = t
            if (b := table.backward[t, s]) != IDLE:
                vs, j = _virtual(b, s, stages, microbatches)
                assert (vs, j) not in backpropagated
                needs = forwarded.get((vs, j)) if vs == last else backpropagated.get((vs + 1, j))
                assert needs is not None and needs < t, f"B{j} on virtual stage {vs} before its gradient"
                backpropagated[(vs, j)] = t
    every = {(vs, j) for vs in range(last + 1) for j in range(microbatches)}
    assert forwarded.keys() == every and backpropagated.keys() == every
    # Split backwards: each unit's weight pass once, in a step after its backward.
    weighed = [(_virtual(w, s, stages, microbatches), t)
               for t in range(table.steps) for s in range(stages) if (w := table.weight[t, s]) != IDLE]  # fmt: skip
    if table.split:
        assert sorted(unit for unit, _ in weighed) == sorted(every)
        assert all(backpropagated[unit] < t for unit, t in weighed)
    else:
        assert not weighed


@pytest.mark.parametrize("kind, stages, microbatches, chunks", CASES)
def test_buffers_hand_each_read_the_value_written_for_it(kind, stages, microbatches, chunks):
    """Replays the slots: each step's arrivals are written after its reads, into the slot the table
    names; every read must find the unit it is for (not a later arrival written over it)."""
    table = build(kind, stages, microbatches, chunks)
    last = stages * chunks - 1
    xbuf = [[None] * (table.x_slots + 1) for _ in range(stages)]
    gbuf = [[None] * (table.g_slots + 1) for _ in range(stages)]
    for t in range(table.steps):
        sent_x, sent_g = [None] * stages, [None] * stages
        for s in range(stages):
            if (b := table.backward[t, s]) != IDLE:
                vs, j = _virtual(b, s, stages, microbatches)
                assert gbuf[s][table.backward_g[t, s]] == ("g", vs, j)
                assert vs == 0 or xbuf[s][table.backward_x[t, s]] == ("x", vs, j)
                sent_g[s] = ("g", vs - 1, j)
            if (f := table.forward[t, s]) != IDLE:
                vs, j = _virtual(f, s, stages, microbatches)
                assert vs == 0 or xbuf[s][table.forward_x[t, s]] == ("x", vs, j)
                if vs == last:
                    gbuf[s][table.loss_g[t, s]] = ("g", vs, j)
                sent_x[s] = ("x", vs + 1, j)
        for s in range(stages):
            xbuf[s][table.received_x[t, s]] = sent_x[(s - 1) % stages]
            gbuf[s][table.received_g[t, s]] = sent_g[(s + 1) % stages]


@pytest.mark.parametrize("kind, stages, microbatches, chunks", SPLIT_CASES)
def test_split_backwards_find_their_residuals_and_taps(kind, stages, microbatches, chunks):
    """Zero-bubble's own buffers, replayed in the loop's order (weight pass, backward, forward):
    a backward reads the residuals its forward stored, a weight pass the taps its backward stored."""
    table = build(kind, stages, microbatches, chunks)
    rbuf = [[None] * (table.r_slots + 1) for _ in range(stages)]
    wbuf = [[None] * (table.w_slots + 1) for _ in range(stages)]
    for t in range(table.steps):
        for s in range(stages):
            if (w := table.weight[t, s]) != IDLE:
                assert wbuf[s][table.weight_w[t, s]] == w
            if (b := table.backward[t, s]) != IDLE:
                assert rbuf[s][table.backward_r[t, s]] == b
                wbuf[s][table.backward_w[t, s]] = b
            if (f := table.forward[t, s]) != IDLE:
                rbuf[s][table.forward_r[t, s]] = f


@pytest.mark.parametrize(
    "kind, chunks",
    [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zero_bubble", 1), ("interleaved_zero_bubble", 2)],
)
@pytest.mark.parametrize("stages", [2, 4])
def test_units_in_flight_are_set_by_the_stages_not_the_microbatches(kind, chunks, stages):
    """Stage s holds 2(S − s) − 1 units in flight (lockstep 1F1B), (v − 1)·S more interleaved, the
    same at M = 4S and 8S, where GPipe holds all M; its input buffer has no more slots. Splitting
    the backward changes none of it."""
    for m in (4 * stages, 8 * stages):
        table = build(kind, stages, m, chunks)
        assert list(table.held) == [2 * (stages - s) - 1 + (chunks - 1) * stages for s in range(stages)]
        assert table.x_slots <= max(table.held) and table.g_slots <= 2


@pytest.mark.parametrize("kind, stages, microbatches, chunks", [c for c in CASES if c[0] not in SPLIT_SCHEDULES])
def test_bubble_is_the_planners(kind, stages, microbatches, chunks):
    """The timetable's idle fraction, each step as long as its busiest stage, is the schedule's
    stated bubble whatever the cells cost: 1F1B's is GPipe's, interleaved 1F1B's the circular
    schedule's."""
    table = build(kind, stages, microbatches, chunks)
    stated = Schedule(stages, chunks, microbatches, kind).bubble
    for costs in (Costs(1, 0.5, 0.5), Costs(), Costs(1, 2, 1), Costs(1.6, 2.1, 1.4)):
        assert table.bubble(costs) == pytest.approx(stated)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (4, 16)])
def test_interleaving_two_chunks_shrinks_the_bubble_to_at_most_0_6_of_1f1b(stages, microbatches):
    interleaved = build("interleaved_1f1b", stages, microbatches, 2).bubble()
    assert interleaved <= 0.6 * build("1f1b", stages, microbatches, 1).bubble()


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_zero_bubble_halves_1f1b_bubble_and_puts_off_fewer_than_2s_weight_passes(stages):
    """With a forward, an input gradient and a weight pass each costing 1 (1F1B's backward 2), the
    bubble is at most half 1F1B's from M = 2S; the weight passes a stage puts off (its taps'
    slots) and the units it holds stay below 2S at M = 2S, 4S and 8S."""
    for m in (2 * stages, 4 * stages, 8 * stages):
        table = build("zero_bubble", stages, m, 1)
        assert table.bubble() <= 0.5 * build("1f1b", stages, m, 1).bubble()
        assert table.w_slots < 2 * stages and table.r_slots < 2 * stages
        assert list(table.held) == [2 * (stages - s) - 1 for s in range(stages)]


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_interleaved_zero_bubble_has_at_most_a_third_of_1f1bs_bubble_where_zero_bubble_has_half(stages):
    """From M = 2S, with two chunks a stage, the bubble is at most a quarter of 1F1B's at the
    literature's equal costs, and at most 0.35 of it where an input gradient costs 1.5 forwards
    and a weight pass 0.8, where zero-bubble's (ZB-H1) is over half of it; its input buffer is
    interleaved 1F1B's, and it puts off fewer than 2S weight passes."""
    for m in (2 * stages, 4 * stages, 8 * stages):
        table = build("interleaved_zero_bubble", stages, m, 2)
        one_f_one_b = build("1f1b", stages, m, 1).bubble()
        assert table.bubble() <= 0.25 * one_f_one_b
        assert table.bubble(Costs(1, 1.5, 0.8)) <= 0.35 * one_f_one_b
        assert build("zero_bubble", stages, m, 1).bubble(Costs(1, 1.5, 0.8)) > 0.5 * one_f_one_b
        assert table.x_slots == build("interleaved_1f1b", stages, m, 2).x_slots
        assert table.w_slots < 2 * stages
