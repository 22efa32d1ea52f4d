"""The serving engine: a request generates the same tokens alone as among seven others that join
at staggered steps, greedy and sampled, with the model's log-probabilities; the prompt's NLL is
the model's; prompts go to the right bucket."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from jaxllm.model.decoder import forward
from jaxllm.model.sampling import Sampling
from jaxllm.serve.engine import DecodeState, bucket_for, decode, insert, prefill, prompt_buckets
from jaxllm.train.step import init_params

SLOTS, BUCKET, MAX_LEN, NEW = 8, 16, 48, 12
PROMPTS = [3, 10, 5, 16, 1, 12, 7, 4]


def _engine():
    cfg = small_config()
    model, params = cfg.model, init_params(cfg)
    vocab = model.vocab_size
    steps = {
        "prefill": jax.jit(partial(prefill, model=model, max_len=MAX_LEN)),
        "insert": jax.jit(partial(insert, vocab_size=vocab), donate_argnums=1),
        "decode": jax.jit(partial(decode, model=model, vocab_size=vocab), donate_argnames="state"),
    }
    return model, params, steps


def _requests(vocab):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, n).tolist() for n in PROMPTS]
    settings = [Sampling.one(temperature=0.0 if r % 2 else 0.9, top_k=20 * (r % 3), seed=100 + r) for r in range(SLOTS)]
    return prompts, settings


def _run(params, steps, model, prompts, settings, joins: dict[int, list[int]]) -> dict[int, list[int]]:
    """Requests join at the decode steps given (step → request ids), each into the next free slot."""
    state, out, slot_of, logprobs = DecodeState.empty(model, SLOTS, MAX_LEN), {}, {}, {}
    for step in range(max(joins) + NEW):
        for r in joins.get(step, []):
            padded = jnp.asarray(prompts[r] + [0] * (BUCKET - len(prompts[r])), jnp.int32)
            prefix = steps["prefill"](params, tokens=padded, length=jnp.asarray(len(prompts[r])))
            slot = len(slot_of)
            state, first = steps["insert"](prefix, state, jnp.asarray(slot), settings[r])
            slot_of[r], out[r], logprobs[r] = slot, [int(first.ids[0])], [_row(first, 0)]
        state, tokens = steps["decode"](params, state=state)
        for r, slot in slot_of.items():
            if len(out[r]) < NEW:
                out[r].append(int(tokens.ids[slot]))
                logprobs[r].append(_row(tokens, slot))
    return out, logprobs


def _row(tokens, slot):
    """(chosen log-prob, top ids, top log-probs) of one slot."""
    return float(tokens.logprobs[slot]), np.asarray(tokens.top_ids[slot]), np.asarray(tokens.top_logprobs[slot])


def test_a_request_generates_the_same_alone_or_among_others():
    model, params, steps = _engine()
    prompts, settings = _requests(model.vocab_size)
    joins = {0: [3], 1: [0, 5], 4: [1], 5: [7, 2], 9: [6, 4]}
    together, logprobs = _run(params, steps, model, prompts, settings, joins)
    for r in range(SLOTS):
        alone, _ = _run(params, steps, model, prompts, settings, {0: [r]})
        assert alone[r] == together[r], r
    for r in (1, 2):  # greedy (each token the model's argmax) and sampled at temperature 0.9, top-k 40
        seq = prompts[r] + together[r]
        want = jax.nn.log_softmax(forward(params, jnp.asarray([seq]), model)[0, len(prompts[r]) - 1 : -1], -1)
        if r == 1:
            assert np.argmax(want, -1).tolist() == together[r]
        for i, (chosen, top_ids, top_logprobs) in enumerate(logprobs[r]):  # raw model log-probs
            np.testing.assert_allclose(chosen, want[i, together[r][i]], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(top_ids, np.argsort(-np.asarray(want[i]), kind="stable")[:20])
            np.testing.assert_allclose(top_logprobs, want[i, top_ids], rtol=1e-4, atol=1e-4)


def test_prefill_reports_each_prompt_tokens_nll():
    model, params, steps = _engine()
    prompt = _requests(model.vocab_size)[0][1]
    padded = jnp.asarray(prompt + [0] * (BUCKET - len(prompt)), jnp.int32)
    prefix = steps["prefill"](params, tokens=padded, length=jnp.asarray(len(prompt)))
    log_probs = jax.nn.log_softmax(forward(params, jnp.asarray([prompt]), model)[0], -1)
    want = [0.0] + [-float(log_probs[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    np.testing.assert_allclose(prefix.nll[: len(prompt)], want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(prefix.nll[len(prompt) :]) == 0)


def test_prompt_buckets_are_powers_of_two_up_to_the_limit():
    assert prompt_buckets(8192, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert prompt_buckets(100, 2048) == [16, 32, 64, 100]
    assert prompt_buckets(10, 2048) == [10]
    buckets = prompt_buckets(100, 2048)
    assert [bucket_for(n, buckets) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]
    with pytest.raises(ValueError, match="a prompt of 101 tokens does not fit: prompts take 1 to 100 tokens"):
        bucket_for(101, buckets)
