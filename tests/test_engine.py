"""The serving engine: a request generates the same tokens alone as among seven others that join
at staggered steps, greedy and sampled; the prompt's NLL matches the model's."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from conftest import small_config

from jaxllm.model.decoder import forward
from jaxllm.model.sampling import Sampling
from jaxllm.serve.engine import DecodeState, decode, insert, prefill
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
    state, out, slot_of = DecodeState.empty(model, SLOTS, MAX_LEN), {}, {}
    for step in range(max(joins) + NEW):
        for r in joins.get(step, []):
            padded = jnp.asarray(prompts[r] + [0] * (BUCKET - len(prompts[r])), jnp.int32)
            prefix = steps["prefill"](params, tokens=padded, length=jnp.asarray(len(prompts[r])))
            slot = len(slot_of)
            state, first = steps["insert"](prefix, state, jnp.asarray(slot), settings[r])
            slot_of[r], out[r] = slot, [int(first)]
        state, tokens = steps["decode"](params, state=state)
        for r, slot in slot_of.items():
            if len(out[r]) < NEW:
                out[r].append(int(tokens[slot]))
    return out


def test_a_request_generates_the_same_alone_or_among_others():
    model, params, steps = _engine()
    prompts, settings = _requests(model.vocab_size)
    together = _run(params, steps, model, prompts, settings, {0: [3], 1: [0, 5], 4: [1], 5: [7, 2], 9: [6, 4]})
    for r in range(SLOTS):
        alone = _run(params, steps, model, prompts, settings, {0: [r]})
        assert alone[r] == together[r], r
    greedy = prompts[1] + together[1]  # request 1 is greedy: each token the model's argmax
    logits = forward(params, jnp.asarray([greedy]), model)[0, :, : model.vocab_size]
    assert np.argmax(logits[len(prompts[1]) - 1 : -1], -1).tolist() == together[1]


def test_prefill_reports_each_prompt_tokens_nll():
    model, params, steps = _engine()
    prompt = _requests(model.vocab_size)[0][1]
    padded = jnp.asarray(prompt + [0] * (BUCKET - len(prompt)), jnp.int32)
    prefix = steps["prefill"](params, tokens=padded, length=jnp.asarray(len(prompt)))
    log_probs = jax.nn.log_softmax(forward(params, jnp.asarray([prompt]), model)[0], -1)
    want = [0.0] + [-float(log_probs[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    np.testing.assert_allclose(prefix.nll[: len(prompt)], want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(prefix.nll[len(prompt) :]) == 0)
