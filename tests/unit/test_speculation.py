"""Speculative decoding by prompt lookup (serve.speculative=ngram) and by a draft model
(serve.speculative=draft) against plain decoding of the same checkpoint: greedy outputs are
identical token for token, with the same log-probs, on one device and tensor-parallel over two,
with the prefix cache, under preemption and with stop strings; a sampled request's output depends
on its request alone; drafts are accepted (all of them when the draft is the served model itself,
whose cache must then follow the target's exactly), the pages of rejected ones go back, and
/metrics counts them. (That sampled tokens follow the target's distribution exactly is
`test_sampling`'s, at the verification itself.)"""

import contextlib
import dataclasses
import types
from typing import NamedTuple

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from support.fake_device import FakeDevice, fake_engine
from support.runs import small_config
from support.serving import http_server, metric_values

from jaxllm.checkpoint import CheckpointError, write_export
from jaxllm.config import ConfigError
from jaxllm.data.tokenizer import get_tokenizer, save_tokenizer, train_bpe
from jaxllm.model import Model
from jaxllm.serve.generation import Request
from jaxllm.serve.load import load_engine, serving_setup
from jaxllm.serve.lookup import propose
from jaxllm.serve.scheduler import State
from jaxllm.serve.settings import LONGEST_BACK_OFF, ServeConfig
from jaxllm.serve.speculation import Pace, hold_back

# Pages of 4 tokens: drafts often cross into a page. Every test shares these settings, so that the
# engines the module builds (each compiles every step) serve several tests.
SERVE = {"serve.slots": 4, "model.max_seq_len": 256, "serve.max_len": 160, "serve.prefill_chunk": 32,
         "serve.dtype": "float32", "serve.page_size": 4}  # fmt: skip
# Every verify step these engines can take, they take (serve.speculative_auto off): what they
# decide by their steps' times is `test_the_engine_verifies_where_verify_steps_pay`'s.
NGRAM = {"serve.speculative": "ngram", "serve.draft_tokens": 3, "serve.ngram_min": 1, "serve.speculative_auto": False}


def _draft(path) -> dict:
    return {"serve.speculative": "draft", "serve.draft_model": str(path), "serve.draft_tokens": 3,
            "serve.speculative_auto": False}  # fmt: skip


@pytest.fixture(scope="module")
def small_draft(trained, tmp_path_factory):
    """A draft model of another shape with the served model's tokenizer: random weights, so that
    many of its proposals are rejected."""
    directory = tmp_path_factory.mktemp("draft")
    cfg = small_config(vocab_size=300, num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, mlp=64)
    write_export(directory, cfg, Model(cfg.model).init(7), 0)
    save_tokenizer(trained[2], directory / "tokenizer")
    return directory


@pytest.fixture(scope="module")
def engines(trained):
    built = {}

    def get(**settings):
        settings = {"serve.tensor": 1, **settings}
        key = tuple(sorted(settings.items()))
        if key not in built:
            built[key] = load_engine(trained[0], {**SERVE, **settings})
        return built[key]

    return get


def _prompts(tokenizer) -> list[list[int]]:
    """Text that repeats (code, a list) beside text that does not."""
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    rng = np.random.default_rng(0)
    return [tokenizer.encode(code), tokenizer.encode("[1, 2, 3], [1, 2, 3], [1, 2"), rng.integers(0, 300, 40).tolist()]


def _outputs(engine, requests):
    return [[(c.tokens, c.finish_reason, c.logprobs) for c in g.choices()] for g in engine.generate(requests)]


def _same(plain, speculative):
    """Equal tokens and finish reasons, and log-probs equal to float precision."""
    for p_choices, s_choices in zip(plain, speculative, strict=True):
        for (p_tokens, p_reason, p_logs), (s_tokens, s_reason, s_logs) in zip(p_choices, s_choices, strict=True):
            assert (s_tokens, s_reason) == (p_tokens, p_reason)
            for p, s in zip(p_logs, s_logs, strict=True):
                np.testing.assert_allclose(s.logprob, p.logprob, atol=1e-4)
                assert [t for t, _ in s.top[:3]] == [t for t, _ in p.top[:3]]


@pytest.mark.parametrize("tensor,proposer", [(1, "ngram"), (2, "ngram"), (1, "itself"), (2, "small draft")])
def test_greedy_speculation_is_greedy_decoding_token_for_token(trained, engines, small_draft, tensor, proposer):
    tokenizer = trained[2]
    speculating = {"ngram": NGRAM, "itself": _draft(trained[0]), "small draft": _draft(small_draft)}[proposer]
    plain, speculative = engines(**{"serve.tensor": tensor}), engines(**{"serve.tensor": tensor}, **speculating)
    drafted = speculative.draft_tokens
    requests = [Request(p, 48, temperature=0.0, ignore_eos=True, logprobs=3) for p in _prompts(tokenizer)]
    accepted = speculative.accepted_tokens
    generations = [speculative.submit(r) for r in requests]
    while speculative.busy():
        speculative.step()
        for s in speculative.scheduler.running:  # read back: no page past its next position
            if s.state is State.DECODE and s.issued == len(s.output):
                assert len(s.pages) <= speculative.pool.pages_for(s.position + 1)
    got = [[(c.tokens, c.finish_reason, c.logprobs) for c in g.choices()] for g in generations]
    _same(_outputs(plain, requests), got)
    assert speculative.draft_tokens > drafted and speculative.pool.in_use() == 0
    assert speculative.device.mesh.shape["tensor"] == tensor
    if proposer == "itself":  # greedy proposals of the target itself: every one is accepted
        assert speculative.accepted_tokens - accepted == speculative.draft_tokens - drafted
    elif proposer == "ngram":  # some lookups are kept (the random small draft's proposals may all be rejected)
        assert speculative.accepted_tokens > accepted


def test_speculation_ends_at_stop_strings_as_plain_decoding_does(trained, engines):
    tokenizer = trained[2]
    plain, speculative = engines(), engines(**NGRAM)
    prompt = _prompts(tokenizer)[0]
    free = plain.generate([Request(prompt, 48, temperature=0.0, ignore_eos=True)])[0].choices()[0]
    stop = free.text[len(free.text) // 2 :][:3]  # somewhere a draft may run past
    requests = [Request(prompt, 48, temperature=0.0, ignore_eos=True, stop=(stop,))]
    _same(_outputs(plain, requests), _outputs(speculative, requests))
    assert speculative.generate(requests)[0].choices()[0].finish_reason == "stop"


def test_prompt_lookup_never_waits_for_a_steps_tokens(trained, engines):
    """The device proposes from the tokens it holds, so each engine step dispatches a decode step
    before it reads the last one: the only engine steps that dispatch no decode are a request's
    prefills and its last read."""
    engine = engines(**NGRAM)
    for prompt in _prompts(trained[2]):  # repeating text, and random tokens between lookups that miss
        verified, idle, prefills = engine.drafts, 0, -(-len(prompt) // SERVE["serve.prefill_chunk"])
        engine.submit(Request(prompt, 48, temperature=0.0, ignore_eos=True))
        while engine.busy():
            idle += engine.step() == 0
        assert idle <= prefills + 1
    assert engine.drafts > verified


@pytest.mark.parametrize("shortest", [1, 2])
def test_the_device_holds_each_sequences_tokens_and_knows_whether_they_recur(trained, engines, shortest):
    """What prompt lookup reads: after each engine step, the prompt and every output token read
    back sit at their positions of the sequence's pages (the prefill wrote the prompt, each
    decode step what it fed), whatever drafts the steps rejected; and the last decode step read
    said whether a lookup after its last token finds a proposal, as a search of the whole context
    does, where some do and some do not."""
    engine = engines(**{**NGRAM, "serve.ngram_min": shortest})
    prompts = _prompts(trained[2])
    generations = [engine.submit(Request(p, 40, temperature=0.0, ignore_eos=True)) for p in prompts]
    checked, recurred = 0, set()
    while engine.busy():
        engine.step()
        pool = np.asarray(engine.device.slots_state.tokens)
        for s in engine.scheduler.running:
            if s.state is State.DECODE and s.output:
                known = s.prompt + s.output[:-1]  # the last read token is fed by a step not yet run, or running
                assert pool[s.pages].ravel()[: len(known)].tolist() == known
                checked += 1
            if s.state is State.DECODE and len(s.output) > 1:  # a decode step's flag was read
                context = s.prompt + s.output
                assert s.recurs == bool(_searched(context, 1, engine.settings.ngram_max, shortest)), context
                recurred.add(s.recurs)
    assert checked > 20 and all(g.choices()[0].tokens for g in generations) and recurred == {True, False}


def test_prompt_lookup_asks_for_drafts_only_where_the_last_step_found_a_proposal(trained, engines):
    """Once a decode step has been read, a verify step is dispatched for a sequence only where the
    decode step read last found its context's last tokens earlier (and it is not backing off
    after rejected drafts); sampled text decodes by plain steps between them."""
    engine = engines(**{**NGRAM, "serve.ngram_min": 2})
    real, wanted = engine.device.decode, []

    def decode(batch):
        (s,) = engine.scheduler.running
        if len(s.output) > 1:  # a decode step's flag was read
            room = s.generation.request.max_tokens - s.issued - 1 > 0
            wanted.append((bool((batch.drafts >= 0).any()), s.recurs and s.issued >= s.resume_at and room))
        return real(batch)

    engine.device.decode = decode
    try:
        engine.generate([Request(_prompts(trained[2])[0], 60, temperature=1.0, seed=1, ignore_eos=True)])
    finally:
        engine.device.decode = real
    asked, expected = zip(*wanted, strict=True)
    assert asked == expected and set(asked) == {True, False}


class _Calls:
    """The engine's runner, noting at each decode dispatch how many decode steps, and how many
    verify steps, were unread, and whether it verifies drafts."""

    def __init__(self, engine):
        self.engine, self.runner, self.dispatches = engine, engine.device, []
        self.unread: dict[int, bool] = {}  # each unread decode step: whether it verifies

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def decode(self, batch):
        pending = self.runner.decode(batch)
        verifies = bool(batch.drafts.shape[1])
        self.dispatches.append((len(self.unread), sum(self.unread.values()), verifies))
        self.unread[id(pending)] = verifies
        return pending

    def read(self, pending):
        self.unread.pop(id(pending), None)
        return self.runner.read(pending)


@pytest.mark.parametrize("proposer", ["ngram", "itself"])
def test_a_sequence_steps_on_before_a_verify_step_is_read(trained, engines, proposer):
    """Every decode step after a request's first is dispatched while the one before it runs, by
    prompt lookup as with a draft model, verify steps too (the device moves a step back by the
    drafts the one before rejects). The output is greedy decoding's either way (tested above)."""
    engine = engines(**(NGRAM if proposer == "ngram" else _draft(trained[0])))
    engine.device = calls = _Calls(engine)
    try:
        engine.generate([Request(_prompts(trained[2])[1], 48, temperature=0.0, ignore_eos=True)])
    finally:
        engine.device = calls.runner
    assert all(unread for unread, _, _ in calls.dispatches[1:])
    assert sum(1 for _, unread_verifies, verifies in calls.dispatches if unread_verifies and verifies) >= 3


def test_a_draft_model_reads_back_what_plain_steps_decoded_when_it_drafts_again(trained, engines):
    """A draft model reads nothing in plain steps: where a sequence backs off (forced here, for 5
    tokens while another speculates beside it, then alone for as many as the draft reads back at
    most: the longest back-off and a verify step's drafts, which a step in flight adds), the draft
    reads those tokens back in the step that drafts again. Drafting with the served
    model itself, its cache then holds the target's keys and values at every position it has
    read, and its proposals are all accepted."""
    engine = engines(**_draft(trained[0]))
    k = engine.settings.draft_tokens  # a back-off this long leaves the draft 32 + K behind (see below)
    back_offs = [(8, 5), (40, LONGEST_BACK_OFF + 2 * k)]  # (after this many output tokens, tokens issued)
    real, plain_steps = engine.device.decode, []

    def decode(batch):
        first = engine.scheduler.running[0]
        if back_offs and len(first.output) >= back_offs[0][0]:
            first.resume_at = first.issued + back_offs.pop(0)[1]
        plain_steps.append(batch.drafts.shape[1] == 0)
        pages.update(slot=first.slot, pages=list(first.pages))
        if batch.drafts.shape[1] and first.slot in batch.slots:  # how far behind the draft is, to read back now
            read = int(engine.device.slots_state.draft_read[first.slot])
            gaps.append(int(batch.positions[list(batch.slots).index(first.slot)]) - read)
        return real(batch)

    prompts = _prompts(trained[2])
    requests = [Request(prompts[0], 90, temperature=0.0, ignore_eos=True),
                Request(prompts[1], 24, temperature=0.0, ignore_eos=True)]  # fmt: skip
    drafted, accepted = engine.draft_tokens, engine.accepted_tokens
    engine.device.decode, pages, gaps = decode, {}, []
    try:
        got = _outputs(engine, requests)
    finally:
        engine.device.decode = real
    read = int(engine.device.slots_state.draft_read[pages["slot"]])  # the first request's, in its last step
    at = np.arange(read)
    page, offset = np.asarray(pages["pages"])[at // SERVE["serve.page_size"]], at % SERVE["serve.page_size"]
    for target, draft in zip(engine.device.pools, engine.device.draft_pools, strict=True):  # [layers, pages, kv, ...]
        read_back, want = (np.asarray(pool)[:, page, :, offset] for pool in (draft, target))
        np.testing.assert_allclose(read_back, want, atol=1e-4)
    assert read > len(requests[0].prompt) + 80
    _same(_outputs(engines(), requests), got)
    # Issued counts the drafts of the step in flight: the draft falls 32 + K tokens behind.
    assert max(gaps) == LONGEST_BACK_OFF + k and sum(plain_steps) > LONGEST_BACK_OFF and not back_offs
    assert engine.accepted_tokens - accepted == engine.draft_tokens - drafted > 0


@pytest.mark.parametrize("proposer", ["ngram", "small draft"])
def test_preempted_speculating_sequences_resume_with_their_output(trained, engines, small_draft, proposer):
    """A pool too small for four growing requests: sequences are preempted mid-speculation and
    prefill again (the draft model's cache too); greedy ones equal plain decoding, sampled ones
    their own output alone."""
    tokenizer = trained[2]
    small = {"serve.kv_pages": 64, "serve.max_len": 128}  # 256 tokens
    speculating = NGRAM if proposer == "ngram" else _draft(small_draft)
    plain, speculative = engines(**small), engines(**small, **speculating)
    prompts = _prompts(tokenizer)
    requests = [Request(prompts[r % 3][:40], 80, temperature=0.0 if r % 2 else 0.8, seed=r, ignore_eos=True)
                for r in range(4)]  # fmt: skip
    together = _outputs(speculative, requests)
    assert speculative.scheduler.preemptions > 0 and speculative.pool.in_use() == 0
    greedy = [r for r in range(4) if requests[r].temperature == 0]
    _same([_outputs(plain, [requests[r]])[0] for r in greedy], [together[r] for r in greedy])
    for r in range(4):
        _same([together[r]], _outputs(speculative, [requests[r]]))


def test_a_server_speculates_only_while_few_enough_sequences_decode(trained, engines):
    """With serve.speculative_max_batch 1, two requests that decode together take plain steps
    only, where each alone would verify drafts; once the shorter ends, the other speculates, and
    the greedy outputs are plain decoding's."""
    engine = engines(**NGRAM, **{"serve.speculative_max_batch": 1})
    real, steps = engine.device.decode, []

    def decode(batch):
        steps.append((int((batch.positions >= 0).sum()), batch.drafts.shape[1] > 0))  # (sequences, verifies)
        return real(batch)

    prompts = _prompts(trained[2])
    requests = [Request(prompts[0], 48, temperature=0.0, ignore_eos=True),
                Request(prompts[1], 16, temperature=0.0, ignore_eos=True)]  # fmt: skip
    engine.device.decode = decode
    try:
        got = _outputs(engine, requests)
    finally:
        engine.device.decode = real
    _same(_outputs(engines(), requests), got)
    together = [verifies for sequences, verifies in steps if sequences > 1]
    assert len(together) >= 8 and not any(together) and any(verifies for _, verifies in steps)


class _Step(NamedTuple):
    pending: object
    catches_up: bool


class _Priced:
    """An engine's device whose reads advance a clock by a price a step: 1 for a plain step or a
    prefill, `verify` for a step in which some row was proposed tokens (its row holds a token or a
    rejection after its first), and `catch_up` more where a row asks for drafts after a plain step
    of its slot (a draft model reads back the plain steps' tokens). It notes the output indices at
    which each slot asks for drafts."""

    def __init__(self, device, verify: float, catch_up: float = 0.0):
        self.device, self.verify, self.catch_up, self.now = device, verify, catch_up, 0.0
        self.drafting: dict[int, list[int]] = {}
        self._plain: set[int] = set()  # slots whose last decode step was plain

    def __getattr__(self, name):
        return getattr(self.device, name)

    def prefill(self, batch):
        self._plain.difference_update(batch.slots.tolist())
        return self.device.prefill(batch)

    def decode(self, batch):
        live = batch.positions >= 0
        wanted = (batch.drafts >= 0).any(axis=1) & live
        for slot, index in zip(batch.slots[wanted], batch.index[wanted], strict=True):
            self.drafting.setdefault(int(slot), []).append(int(index))
        catches_up = any(int(slot) in self._plain for slot in batch.slots[wanted])
        self._plain = (self._plain | set(batch.slots[live & ~wanted].tolist())) - set(batch.slots[wanted].tolist())
        return _Step(self.device.decode(batch), catches_up)

    def clock(self) -> float:
        return self.now

    def read(self, pending):
        pending, catches_up = (pending.pending, pending.catches_up) if isinstance(pending, _Step) else (pending, False)
        tokens, *rest = self.device.read(pending)
        verified = tokens.ids.ndim == 2 and (tokens.ids[:, 1:] != -1).any()
        self.now += self.verify + self.catch_up * catches_up if verified else 1.0
        return tokens, *rest


@contextlib.contextmanager
def _priced(engine, verify_price: float, catch_up: float = 0.0, **settings):
    """`engine` on a `_Priced` device (yielded), its clock, with `settings` changed, a new `Pace`
    and an empty prefix cache (each run from the same start); restored after."""
    real, clock, before, pace = engine.device, engine.clock, engine.settings, engine.pace
    engine.device = priced = _Priced(real, verify_price, catch_up)
    engine.settings, engine.clock, engine.pace = dataclasses.replace(before, **settings), priced.clock, Pace(3)
    engine.pool.forget()
    engine._last_decode_read = None
    try:
        yield priced
    finally:
        engine.device, engine.clock, engine.settings, engine.pace = real, clock, before, pace
        engine._last_decode_read = None


@pytest.mark.parametrize("temperature,verify_price,faster", [(0.0, 1.25, "always"), (0.0, 2.5, None),
                                                            (0.0, 5.0, "plain"), (1.0, 2.5, "plain")])  # fmt: skip
def test_the_engine_verifies_where_verify_steps_pay(trained, engines, temperature, verify_price, faster):
    """The engine (serve.speculative_auto) against one that always verifies and plain decoding,
    on a device whose verify steps cost `verify_price` plain steps: it saves two thirds or more of
    the time that the faster of them saves over the slower, finding the steps' costs and the
    proposals' yield as it goes. Greedy, whose proposals are mostly kept: at 1.25 always verifying is faster, at 5
    (more than a verify step of 3 drafts yields) plain decoding; at 2.5, where neither is much
    faster, the engine is faster than both, as it holds back where too few of the batch's
    sequences have drafts to pay. Sampled, whose proposals are mostly rejected, plain decoding is
    faster at 2.5.
    A greedy sequence, which has a proposal at every step, verifies at least every
    `LONGEST_BACK_OFF` tokens or so (its acceptance followed; a draft model's cache reads back no
    more). Each policy's time is its device's clock; the outputs are plain decoding's."""
    engine = engines(**NGRAM)
    prompts = _prompts(trained[2])
    requests = [Request(p, 88, temperature=temperature, seed=i, ignore_eos=True) for i, p in enumerate(prompts)]
    policies = {"auto": {"speculative_auto": True}, "always": {}, "plain": {"speculative": "off"}}
    took, outputs, devices, held_back = {}, {}, {}, {}
    for policy, changes in policies.items():
        with _priced(engine, verify_price, **changes) as devices[policy]:
            before = engine.held_back
            outputs[policy], took[policy] = _outputs(engine, requests), devices[policy].now
            held_back[policy] = engine.held_back - before
    assert outputs["auto"] == outputs["always"] == outputs["plain"]
    assert held_back["always"] == held_back["plain"] == 0
    if temperature == 0:  # every step finds a proposal: however dear, it verifies every so often
        for indices in devices["auto"].drafting.values():
            assert np.diff([0, *indices, 88]).max() <= LONGEST_BACK_OFF + 8
    if faster is None:
        assert took["auto"] <= 0.95 * min(took["always"], took["plain"])
    else:
        slower = {"always": "plain", "plain": "always"}[faster]
        assert took[faster] < took[slower] and took[slower] - took["auto"] >= 2 / 3 * (took[slower] - took[faster])


def test_a_draft_models_catch_up_steps_do_not_count_against_verifying(trained, engines):
    """A draft model that is the served model (every draft kept, 4 tokens a verify step), on a
    device whose verify steps cost 3 plain steps and 8 more where the draft reads back plain
    steps: verifying pays, as a run of verify steps catches up once. The engine verifies about
    as often as one that always verifies, where timing the catch-ups among its verify steps
    would have it hold back more (each step held back makes the next verify step catch up)."""
    engine = engines(**_draft(trained[0]))
    requests = [Request(p, 88, temperature=0.0, ignore_eos=True) for p in _prompts(trained[2])]
    took = {}
    for policy, auto in (("auto", True), ("always", False)):
        with _priced(engine, 3.0, 8.0, speculative_auto=auto) as device:
            engine.generate(requests)
            took[policy] = device.now
    assert took["auto"] <= 1.25 * took["always"]  # its tries of plain steps, and the catch-ups after them


def test_a_sampled_request_speculates_the_same_alone_or_among_others(trained, engines):
    tokenizer = trained[2]
    speculative = engines(**NGRAM)
    requests = [Request(p, 32, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True) for p in _prompts(tokenizer)]
    together = _outputs(speculative, requests)
    assert [_outputs(speculative, [r])[0] for r in requests] == together


def test_the_metrics_count_drafts_and_accepted_tokens(trained, engines):
    """And the steps serve.speculative_auto held back, on a device whose verify steps do not pay."""
    tokenizer = trained[2]
    engine = engines(**NGRAM)
    with _priced(engine, 5.0, speculative_auto=True), http_server(engine) as (url, _):
        body = {"model": "m", "prompt": tokenizer.decode(_prompts(tokenizer)[1]), "max_tokens": 64, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        metrics = metric_values(httpx.get(f"{url}/metrics").text)
    drafted, accepted = (metrics[f"vllm:spec_decode_num_{n}_total[0][m]"] for n in ("draft_tokens", "accepted_tokens"))
    assert (drafted, accepted) == (engine.draft_tokens, engine.accepted_tokens) and 0 < accepted <= drafted
    assert metrics["jaxllm_spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert metrics["jaxllm_spec_held_back_steps"] == engine.held_back > 0


def _searched(context: list[int], count: int, longest: int, shortest: int) -> list[int]:
    """The reference: a search of the whole context for its last n tokens, the largest n first."""
    tokens = np.asarray(context, np.int64)
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        earlier = sliding_window_view(tokens[:-1], n)  # every run of n tokens but the last one
        found = np.flatnonzero((earlier == tokens[-n:]).all(axis=1))
        if found.size:
            extended, start = tokens.tolist(), found[-1] + n
            for i in range(count):
                extended.append(extended[start + i])
            return extended[len(tokens) :]
    return []


def lookup(context, count, longest, shortest):
    """One context's proposal by `propose`, after garbage that it must not read."""
    tokens = jnp.asarray([context + [7, 9, 7] * 4], jnp.int32)
    proposed = np.asarray(propose(tokens, jnp.asarray([len(context)]), count, shortest, longest))[0]
    assert (proposed >= 0).all() or (proposed == -1).all()
    return [t for t in proposed.tolist() if t >= 0]


def _timed(pace: Pace, rows: int, kind: str, *seconds: float) -> None:
    for second in seconds:
        pace.time(rows, kind, second)


def test_pace_leaves_out_each_kinds_first_time_and_averages_the_rest():
    pace = Pace(draft_tokens=3)
    _timed(pace, 1, "plain", 9.0, 1.0, 2.0)
    _timed(pace, 1, "verify", 9.0)
    assert pace.seconds == {(1, "plain"): 1.0 + Pace.SMOOTHING * (2.0 - 1.0)}


def test_pace_judges_by_the_nearest_bucket_timed_both_ways():
    pace = Pace(draft_tokens=3)
    _timed(pace, 1, "plain", 0, 1.0)
    _timed(pace, 1, "verify", 0, 2.0)
    _timed(pace, 8, "plain", 0, 1.0)
    _timed(pace, 8, "verify", 0, 4.0)
    # at 2 rows, bucket 1's: verifying pays where it yields over twice a plain step's tokens
    assert pace.verify_pays(2, 2, 4.1) and not pace.verify_pays(2, 2, 3.9)
    # at 4, bucket 8's (twice 4, where 1 is a quarter): over 4 times
    assert pace.verify_pays(4, 4, 16.1) and not pace.verify_pays(4, 4, 15.9)


def test_pace_tries_a_kind_untimed_where_the_other_is_timed_now_and_then():
    pace = Pace(draft_tokens=3)
    assert [pace.verify_pays(1, 1, 4) for _ in range(3)] == [True] * 3  # nothing timed: verify
    _timed(pace, 1, "verify", 0, 2.0)
    decisions = [pace.verify_pays(1, 1, 4) for _ in range(Pace.TRY_EVERY)]
    # a plain step at the first tries and every 64th; between, verify, as nothing is timed both ways
    tried = [j for j, verify in enumerate(decisions, 1) if not verify]
    assert tried == [*range(1, Pace.FIRST_TRIES + 1), Pace.TRY_EVERY]
    _timed(pace, 1, "plain", 0, 1.0)
    _timed(pace, 4, "verify", 0, 9.0)  # dear, plain untimed: bucket 1 says verify, but plain is tried
    assert [pace.verify_pays(4, 4, 16) for _ in range(Pace.FIRST_TRIES + 1)] == [False] * Pace.FIRST_TRIES + [True]


def test_pace_yield_is_the_mean_with_its_guess_then_a_moving_average():
    pace, tokens = Pace(draft_tokens=3), [1, 2, 1, 4] + [2] * 40
    for j, t in enumerate(tokens):
        pace.yielded(t)
        seen = [4] * Pace.PRIOR_ROWS + tokens[: j + 1]
        if len(seen) <= 1 / Pace.YIELD_SMOOTHING:
            assert pace.yield_per_row == pytest.approx(np.mean(seen))
    assert 2 < pace.yield_per_row < np.mean([4] * Pace.PRIOR_ROWS + tokens)  # the early rows fade


def test_a_sequence_with_drafts_held_back_for_the_longest_back_off_verifies_with_the_rest():
    pace = Pace(draft_tokens=3)
    _timed(pace, 2, "plain", 0, 1.0)
    _timed(pace, 2, "verify", 0, 10.0)  # nothing a verify step yields pays

    def sequences(gap: int):
        return [types.SimpleNamespace(drafts=3, issued=100, verified_at=100 - gap, behind=False) for gap in (1, gap)]

    held = sequences(LONGEST_BACK_OFF - 1)
    assert hold_back(held, pace, 2) and [s.drafts for s in held] == [0, 0]
    due = sequences(LONGEST_BACK_OFF)
    assert not hold_back(due, pace, 2) and [s.drafts for s in due] == [3, 3]


class _Stopwatch(FakeDevice):
    """Reading a decode step takes 1 s, a prefill 100 s, on `now`."""

    now = 0.0

    def decode(self, batch):
        return 1.0, super().decode(batch)

    def prefill(self, batch):
        return 100.0, super().prefill(batch)

    def read(self, pending):
        seconds, tokens = pending
        self.now += seconds
        return super().read(tokens)


def test_the_engine_times_decode_steps_without_the_prefills_between_them():
    """A long prompt prefills in chunks beside another sequence's decode steps: the times of
    decode steps read right after a prefill's (101 s) are left out, so both buckets time 1 s."""
    tokenizer = get_tokenizer("gpt2")
    engine = fake_engine(tokenizer, slots=2, max_len=256, prefill_chunk=16)
    engine.device = device = _Stopwatch(engine.slots, tokenizer.vocab_size)
    engine.clock = lambda: device.now
    first = engine.submit(Request(list(range(1, 9)), 64, temperature=1.0, seed=0, ignore_eos=True))
    for _ in range(8):
        engine.step()
    engine.submit(Request(list(range(1, 120)), 16, temperature=1.0, seed=1, ignore_eos=True))
    while engine.busy():
        engine.step()
    assert first.done and engine.pace.seconds == {(1, "plain"): 1.0, (2, "plain"): 1.0}


def test_lookup_proposes_what_followed_the_longest_latest_match():
    assert lookup([1, 2, 3, 4, 5, 6, 1, 2, 3], 3, 4, 2) == [4, 5, 6]  # "1 2 3" matched, three after it
    assert lookup([7, 2, 3, 9, 1, 2, 3, 8, 2, 3], 2, 4, 2) == [8, 2]  # the latest "2 3"
    assert lookup([5, 6, 9, 1, 5, 6, 7, 4, 5, 6], 2, 3, 2) == [7, 4]
    assert lookup([1, 2, 3, 4], 3, 4, 2) == [] and lookup([1, 2, 3, 1], 3, 4, 2) == []  # only a single token repeats
    assert lookup([1, 2, 3, 1], 3, 4, 1) == [2, 3, 1]
    assert lookup([9, 1, 2, 1, 2], 5, 4, 2) == [1, 2, 1, 2, 1]  # a loop goes on around itself
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 4, 4, 2) == [4, 5, 1, 2]
    assert lookup([1, 2, 3, 9, 5, 3, 7, 1, 2, 3], 1, 3, 1) == [9]  # the longest match, over a later shorter one
    assert lookup([], 2, 3, 1) == [] and lookup([4], 2, 3, 1) == []


@pytest.mark.parametrize("shortest, longest", [(1, 3), (2, 4), (3, 3), (1, 16)])
def test_a_batch_of_lookups_proposes_what_a_search_of_each_whole_context_does(shortest, longest):
    """Rows of a few symbols (so that runs repeat) and of every length up to the table's, with
    other tokens past each row's end, looked up in one call: each row's proposal is the search's."""
    rng = np.random.default_rng(shortest * 10 + longest)
    size, count = 64, 9
    lengths = rng.integers(0, size + 1, 200)
    tokens = rng.integers(0, 4, (200, size))
    got = np.asarray(propose(jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths), count, shortest, longest))
    for row, length, proposed in zip(tokens, lengths, got, strict=True):
        want = _searched(row[:length].tolist(), count, longest, shortest) if length else []
        assert [t for t in proposed.tolist() if t >= 0] == want


def test_bad_speculation_settings_are_refused(trained, tmp_path):
    with pytest.raises(ConfigError, match="ngram_min"):
        ServeConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(ConfigError, match="ngram_max=17 must satisfy"):
        ServeConfig(ngram_max=17)
    with pytest.raises(ConfigError, match="draft_tokens"):
        ServeConfig(draft_tokens=0)
    with pytest.raises(ConfigError, match="serve.speculative_max_batch=-1 must be at least 0"):
        ServeConfig(speculative_max_batch=-1)
    with pytest.raises(ConfigError, match="speculative_max_batch=2 holds prompt lookup back, not a draft model"):
        ServeConfig(speculative="draft", draft_model="runs/small", speculative_max_batch=2)
    unpaired = ({"speculative": "draft"}, {"speculative": "draft", "draft_model": ""}, {"draft_model": "runs/small"},
                {"speculative": "ngram", "draft_model": "x"})  # fmt: skip
    for settings in unpaired:
        with pytest.raises(ConfigError, match="a draft model is what serve.speculative=draft proposes with"):
            ServeConfig(**settings)
    # A draft model of another tokenizer would propose ids that mean other words.
    other = tmp_path / "other"
    cfg = small_config(vocab_size=300)
    write_export(other, cfg, Model(cfg.model).init(0), 0)
    vocabulary = train_bpe(iter(["another vocabulary"] * 4), 300, tmp_path / "bpe")
    save_tokenizer(get_tokenizer(vocabulary), other / "tokenizer")
    with pytest.raises(ConfigError, match=f"serve.draft_model={other} has another tokenizer"):
        serving_setup(trained[0], {**SERVE, **_draft(other)})
    with pytest.raises(CheckpointError, match="missing does not exist: no such run or export"):
        serving_setup(trained[0], {**SERVE, **_draft(tmp_path / "missing")})
    # A verify step feeds a token and its drafts into one slot: more than it holds could never be verified.
    with pytest.raises(ConfigError, match="serve.draft_tokens=160 with serve.max_len=160"):
        serving_setup(trained[0], {**SERVE, **NGRAM, "serve.draft_tokens": 160})
    widest = serving_setup(trained[0], {**SERVE, **NGRAM, "serve.draft_tokens": 159})[0].settings
    assert (widest.speculative, widest.draft_tokens, widest.max_len) == ("ngram", 159, 160)
    plain = serving_setup(trained[0], {**SERVE, "serve.draft_tokens": 160})[0].settings  # not speculating: not read
    assert (plain.speculative, plain.draft_tokens) == ("off", 160)
