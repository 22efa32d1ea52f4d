"""The scheduler alone, in plain Python (no model, no JAX): which sequence it preempts when pages
run out, and where that sequence waits. Recomputed outputs are identical whichever it picks, so
only these tests tell a fair scheduler (the newest gives way, as vLLM's does) from one that
starves long requests."""

import time

from jaxllm.data.tokenizer import get_tokenizer
from jaxllm.serve.buckets import Buckets
from jaxllm.serve.generation import Generation, Request
from jaxllm.serve.pages import PagePool
from jaxllm.serve.scheduler import Scheduler, State

TOKENIZER = get_tokenizer("gpt2")
PAGE = 4


def _scheduler(pages: int, slots: int = 3) -> Scheduler:
    pool = PagePool(pages + 1, page_size=PAGE, salt="test", prefix_cache=False)  # + the scratch page
    return Scheduler(pool, slots, Buckets.of(slots=slots, max_len=64, page_size=PAGE, prefill_chunk=64))


def _submit(scheduler: Scheduler, prompt_len: int, first_token: int, max_tokens: int = 12):
    request = Request(prompt=list(range(first_token, first_token + prompt_len)), max_tokens=max_tokens, ignore_eos=True)
    generation = Generation(request, TOKENIZER, deadline=time.monotonic() + 60)
    return scheduler.add(generation, prompt_logprobs=False)[0]


def _step(scheduler: Scheduler) -> list:
    """One engine step: the plan's prefill chunks are dispatched, and every token it samples (a
    final chunk's, each decoding sequence's) is read back (token 7)."""
    plan = scheduler.plan()
    for chunk in plan.prefill:
        scheduler.advance(chunk)
        if chunk.final:
            chunk.sequence.generation.streams[chunk.sequence.choice].push(7)
    for sequence in plan.decode:
        sequence.issued += 1
        sequence.generation.streams[sequence.choice].push(7)
    return plan.decode


def test_the_newest_running_sequence_gives_way_and_waits_at_the_head_of_the_line():
    """Three sequences of a 3-token prompt (1 page each to start) on 5 pages: each takes a page
    every 4 tokens, so the pool runs dry; the one admitted last is preempted, first in line when
    pages come back; the oldest runs on untouched. A fourth request, queued later (no slot is free
    for it), stays behind it."""
    scheduler = _scheduler(pages=5)
    old, middle, new = (_submit(scheduler, 3, 100 * k) for k in (1, 2, 3))
    late = None
    for _ in range(40):
        _step(scheduler)
        if scheduler.preemptions:
            break
        if late is None and len(scheduler.running) == 3:
            late = _submit(scheduler, 3, 400)  # arrives while all three run; no slot frees for it
    assert scheduler.preemptions == 1
    assert new.state is State.WAITING and not new.pages and new.slot is None
    assert old.state is State.DECODE and middle.state is State.DECODE
    assert list(scheduler.waiting) == [new, late], "the preempted sequence waits ahead of requests queued after it"
    assert scheduler.running == [old, middle]


def test_preemption_goes_newest_first_until_the_oldest_can_grow():
    """Pages for two sequences only: as the pool runs dry again and again, the newer of the running
    ones always yields, and the oldest request never loses its pages, so it finishes first."""
    scheduler = _scheduler(pages=6)
    sequences = [_submit(scheduler, 3, 100 * k) for k in (1, 2, 3)]
    preempted, finished = [], []
    for _ in range(300):
        before = list(scheduler.running)  # oldest first
        _step(scheduler)
        gone = [s for s in before if s.state is State.WAITING]
        assert gone == before[len(before) - len(gone) :], "a preemption took other than the newest running"
        preempted += gone
        for s in sequences:
            if s.state is State.DECODE and len(s.output) >= s.generation.request.max_tokens:
                scheduler.finish(s)
                finished.append(s)
        if len(finished) == len(sequences):
            break
    assert preempted and sequences[0] not in preempted, "the oldest request was preempted"
    assert finished == sequences, "requests finished out of their arrival order"
