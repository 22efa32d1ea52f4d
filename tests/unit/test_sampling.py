"""Sampling against numpy: greedy, temperature, top-k, top-p and min-p supports and frequencies, and
temperature with top-k and top-p together; a draw depends on its request only, never on its slot
or neighbours; padded ids are never drawn. Verification of proposed tokens against the exact
distribution of sampling token by token."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxllm.config import ConfigError, RunConfig
from jaxllm.model.sampling import Sampling, sample, verify

PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
VOCAB = len(PROBS)
DRAWS = 4000


def _draws(logits, vocab_size=VOCAB, **settings) -> np.ndarray:
    """DRAWS tokens of one request (seed 7, choice 0), one per token index, all in one batch."""
    batch = Sampling(*(jnp.full((DRAWS,), v) for v in Sampling.one(**{"seed": 7, **settings})))
    logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (DRAWS, len(logits)))
    return np.asarray(sample(logits, batch, jnp.arange(DRAWS), vocab_size))


def _support(probs: np.ndarray, top_k: int, top_p: float, min_p: float = 0.0) -> set[int]:
    """Written independently: those at least min_p times as likely as the likeliest, the k most
    likely of them, then the fewest of those reaching p."""
    order = np.argsort(-probs, kind="stable")
    order = order[probs[order] >= min_p * probs.max()][: top_k or len(probs)]
    kept = probs[order] / probs[order].sum()
    needed = np.searchsorted(np.cumsum(kept), top_p - 1e-9) + 1
    return set(order[:needed].tolist())


# min-p 0.3 keeps the 3 tokens of at least 0.12; top-p 0.8 of those takes 2 (0.4 / 0.8, then 0.65 / 0.8),
# where top-p 0.8 alone takes 3: min-p cuts first, then top-k and top-p over what is left (vLLM's order).
@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0), (3, 1.0, 0), (0, 0.7, 0), (4, 0.5, 0), (1, 1.0, 0),
                                               (0, 0.3, 0), (0, 1.0, 0.3), (0, 0.8, 0.3), (2, 1.0, 0.1)])  # fmt: skip
def test_draws_follow_the_truncated_distribution(top_k, top_p, min_p):
    drawn = _draws(np.log(PROBS), temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    support = _support(PROBS, top_k, top_p, min_p)
    assert set(drawn.tolist()) == support
    want = np.where(np.isin(np.arange(VOCAB), list(support)), PROBS, 0)
    np.testing.assert_allclose(np.bincount(drawn, minlength=VOCAB) / DRAWS, want / want.sum(), atol=0.03)


def test_min_p_of_one_keeps_every_token_tied_at_the_top():
    drawn = _draws(np.log(np.array([0.3, 0.3, 0.2, 0.2])), vocab_size=4, temperature=1.0, min_p=1.0)
    assert set(drawn.tolist()) == {0, 1}


def test_temperature_sharpens_and_zero_is_greedy():
    logits = np.log(PROBS)
    assert set(_draws(logits, temperature=0.0).tolist()) == {0}
    cold = np.bincount(_draws(logits, temperature=0.5), minlength=VOCAB) / DRAWS
    want = PROBS**2 / (PROBS**2).sum()  # p^(1/T), renormalised
    np.testing.assert_allclose(cold, want, atol=0.03)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# (temperature, top_k, top_p): each top-p cut keeps another number of tokens at this temperature
# than at 1, and no cumulative probability lies within 0.02 of its p.
HOT_AND_COLD = [(0.5, 3, 1.0), (2.0, 3, 1.0), (0.5, 0, 0.7), (2.0, 0, 0.7), (2.0, 4, 0.68), (0.6, 4, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", HOT_AND_COLD)
def test_temperature_applies_before_top_k_and_top_p(temperature, top_k, top_p):
    """As Hugging Face's warpers do: the logits are divided by the temperature, then cut to the
    top k and the top p of that distribution, renormalised. The draws' total-variation distance
    from that exact distribution (computed here in numpy) is within sampling noise, and far from
    the one that cuts the unscaled logits."""
    logits = np.log(PROBS)
    scaled = _softmax(logits / temperature)
    support, unscaled_support = _support(scaled, top_k, top_p), _support(PROBS, top_k, top_p)
    if top_p < 1:  # the case this test exists for, and no ties at the cut
        assert support != unscaled_support
        kept = np.sort(scaled[np.argsort(-scaled)[: top_k or VOCAB]])[::-1]
        assert np.abs(np.cumsum(kept / kept.sum()) - top_p).min() > 0.02
    want = np.where(np.isin(np.arange(VOCAB), list(support)), scaled, 0)
    want /= want.sum()
    drawn = _draws(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    got = np.bincount(drawn, minlength=VOCAB) / DRAWS
    assert set(drawn.tolist()) == support
    # 4000 draws of 6 outcomes: a total variation of ~0.01 is noise; cutting the unscaled logits
    # (or drawing from them) moves it by 0.05 or more.
    assert 0.5 * np.abs(got - want).sum() < 0.025, (got, want)


def test_ids_past_the_vocab_are_never_drawn():
    logits = np.log(np.concatenate([PROBS, [0.9, 0.9]]) / 2.7)  # two padded ids, most likely of all
    assert set(_draws(logits, vocab_size=VOCAB, temperature=0.0).tolist()) == {0}
    assert max(_draws(logits, vocab_size=VOCAB, temperature=1.0).tolist()) < VOCAB


def test_a_request_draws_the_same_alone_or_among_others():
    """Slot and neighbours change, (seed, choice, token index) do not: the same tokens."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
    settings = Sampling(
        temperature=jnp.array([1.0, 0.8, 0.0, 1.2, 1.0, 0.7, 1.0, 0.9]),
        top_k=jnp.array([0, 5, 0, 10, 0, 3, 20, 0]),
        top_p=jnp.array([1.0, 0.9, 1.0, 0.8, 0.95, 1.0, 1.0, 0.5]),
        min_p=jnp.array([0.0, 0.0, 0.1, 0.0, 0.05, 0.2, 0.0, 0.0]),
        seed=jnp.arange(8, dtype=jnp.uint32) * 11,
        choice=jnp.array([0, 1, 0, 2, 0, 0, 1, 0]),
    )
    index = jnp.array([3, 0, 7, 12, 1, 5, 9, 2])
    together = np.asarray(sample(logits, settings, index, 50))
    perm = np.array([5, 2, 7, 0, 3, 1, 6, 4])
    shuffled = np.asarray(sample(logits[perm], jax.tree.map(lambda a: a[perm], settings), index[perm], 50))
    np.testing.assert_array_equal(shuffled, together[perm])
    for slot in range(8):
        one = slice(slot, slot + 1)
        alone = sample(logits[one], jax.tree.map(lambda a, one=one: a[one], settings), index[one], 50)
        assert int(alone[0]) == together[slot]
    other_choice = settings._replace(choice=settings.choice + 1)
    assert not np.array_equal(np.asarray(sample(logits, other_choice, index, 50)), together)


@pytest.mark.parametrize("field,value", [("sample_top_p", 0.0), ("sample_top_p", 1.5), ("sample_temperature", -1.0)])
def test_bad_sample_settings_are_refused(field, value):
    with pytest.raises(ConfigError, match="0 < top_p <= 1"):
        RunConfig().updated(train={field: value})


def _verify_draws(logits: np.ndarray, drafts: list[int], rows: int, **settings) -> list[tuple[int, ...]]:
    """Each of `rows` requests (seeds 0..rows-1) verifies `drafts` against the same `logits` [K + 1,
    vocab]: the tokens it outputs."""
    one = Sampling.one(**settings)
    batch = Sampling(*(jnp.full((rows,), v[0]) for v in one))._replace(seed=jnp.arange(rows, dtype=jnp.uint32))
    logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (rows, *logits.shape))
    drafted = jnp.broadcast_to(jnp.asarray(drafts, jnp.int32), (rows, len(drafts)))
    tokens, accepted = verify(logits, drafted, batch, jnp.zeros(rows, jnp.int32), logits.shape[-1])
    rows_out = zip(np.asarray(tokens).tolist(), np.asarray(accepted).tolist(), strict=True)
    return [tuple(row[: a + 1]) for row, a in rows_out]


def _target(probs: np.ndarray, drafts: list[int]) -> dict[tuple[int, ...], float]:
    """The exact distribution of a verification's output, written as plain sampling reads it: token
    j follows p_j; the output goes on past position j only where token j is draft j."""
    outcomes: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], weight: float) -> None:
        j = len(prefix)
        for token, p in enumerate(probs[j]):
            if p > 0:
                goes_on = j < len(drafts) and token == drafts[j]
                (extend if goes_on else outcomes.__setitem__)((*prefix, token), weight * p)

    extend((), 1.0)
    return outcomes


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (1.3, 4, 0.95, 0.0), (1.3, 0, 1.0, 0.05)]
)
def test_verified_tokens_follow_the_targets_distribution(temperature, top_k, top_p, min_p):
    """Speculative sampling is lossless: the output of verifying a likely and an unlikely draft
    follows, by a chi-squared test, the distribution of sampling token by token."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, VOCAB))
    drafts = [int(np.argmax(logits[0])), int(np.argsort(logits[1])[-3])]
    probs = []
    for row in logits / temperature:
        keep = np.isin(np.arange(VOCAB), list(_support(np.exp(row) / np.exp(row).sum(), top_k, top_p, min_p)))
        p = np.where(keep, np.exp(row), 0)
        probs.append(p / p.sum())
    want = _target(np.array(probs), drafts)
    assert len(want) >= 8  # outcomes that stop at each position
    drawn = _verify_draws(logits, drafts, 20000, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    counts = collections.Counter(drawn)
    assert set(counts) <= set(want)
    outcomes = sorted(want)
    observed = np.array([counts[o] for o in outcomes])
    expected = np.array([want[o] for o in outcomes]) * len(drawn)
    assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3


def test_greedy_verification_is_greedy_decoding():
    """A greedy row keeps its drafts while each is the argmax, then corrects the first that is not."""
    logits = np.random.default_rng(4).normal(size=(4, VOCAB))
    best = logits.argmax(-1).tolist()
    for drafts, want in [
        (best[:3], best),
        ([best[0], (best[1] + 1) % VOCAB, best[2]], best[:2]),
        ([(best[0] + 1) % VOCAB, best[1], best[2]], best[:1]),
    ]:
        assert _verify_draws(logits, drafts, 1, temperature=0.0) == [tuple(want)]


def test_a_row_without_drafts_draws_as_plain_sampling():
    logits = np.random.default_rng(5).normal(size=(2, VOCAB))
    rows = 64
    plain = Sampling(*(jnp.full((rows,), v[0]) for v in Sampling.one(temperature=1.0)))._replace(
        seed=jnp.arange(rows, dtype=jnp.uint32)
    )
    want = sample(jnp.broadcast_to(jnp.asarray(logits[0], jnp.float32), (rows, VOCAB)), plain, jnp.zeros(rows), VOCAB)
    drawn = _verify_draws(logits, [-1], rows, temperature=1.0)
    assert [d[0] for d in drawn] == np.asarray(want).tolist() and all(len(d) == 1 for d in drawn)
