"""Stop ids from a model's files, over HTTP: a run whose saved tokenizer has a
generation_config.json naming more ids than eos (as Llama 3's names <|eot_id|>) is served by an
engine loaded from it, in this process, behind the HTTP API. A completion whose greedy
continuation draws one of those ids ends there with finish_reason 'stop', the id neither in its
text nor in its token count, whole and streamed; one whose first token (from the prefill) is one
answers empty; with ignore_eos both run on to max_tokens."""

import json
import shutil

import httpx
import jax
import numpy as np
from support.runs import checkpoint_params
from support.serving import http_server

from jaxllm.checkpoint import stored_config
from jaxllm.data.tokenizer import get_tokenizer, save_tokenizer
from jaxllm.model.decoder import Model
from jaxllm.serve.load import load_engine

NEW = 12
SETTINGS = {"serve.slots": 2, "serve.tensor": 1, "serve.prefill_chunk": 16, "serve.max_prompt_tokens": 32}


def _greedy(workdir, prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """Each prompt's NEW-token greedy continuation by full forward passes of the checkpoint's
    params, independent of the engine."""
    model, params = stored_config(workdir).model, checkpoint_params(workdir, 2)
    logits = jax.jit(lambda tokens: Model(model).logits(params, tokens[None])[0, :, :vocab])
    continuations = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(NEW):
            padded = np.zeros(48, np.int32)  # one compile; causal, so the padding changes nothing before it
            padded[: len(ids)] = ids
            ids.append(int(np.argmax(np.asarray(logits(padded))[len(ids) - 1])))
        continuations.append(ids[len(prompt) :])
    return continuations


def _complete(url: str, body: dict) -> tuple:
    """A completion asked whole and streamed: (its text, finish_reason and completion tokens
    whole, then its streamed text and last finish_reason)."""
    body = {"model": "m", "max_tokens": NEW, "temperature": 0, **body}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
        chunks = [json.loads(line[6:])["choices"][0] for line in streamed.iter_lines() if line.startswith("data: {")]
    choice, tokens = whole.json()["choices"][0], whole.json()["usage"]["completion_tokens"]
    streamed_text = "".join(c["text"] for c in chunks)
    return choice["text"], choice["finish_reason"], tokens, streamed_text, chunks[-1]["finish_reason"]


def test_a_models_extra_stop_ids_end_completions_over_http(trained, tmp_path):
    """One prompt's greedy continuation draws its k-th token (k counted from 0) in a decode step,
    another's first token is drawn by its prefill; the model's generation_config.json names
    both, and each completion ends there."""
    workdir, _, tokenizer = trained
    prompts = [tokenizer.encode("def parse(text):\n    "), tokenizer.encode('{"key": [1, 2')]
    greedy, other = _greedy(workdir, prompts, tokenizer.vocab_size)
    first = other[0]
    # The first token from the second on that neither came before nor is the other stop.
    k = next(k for k in range(1, NEW) if greedy[k] not in greedy[:k] and first not in greedy[: k + 1])
    assert tokenizer.eos_id not in [*greedy, first]
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    (run / "tokenizer" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tokenizer.eos_id, greedy[k], first]})
    )
    save_tokenizer(get_tokenizer(run / "tokenizer"), run / "tokenizer")  # its fingerprint now covers the file
    engine = load_engine(run, SETTINGS)
    assert engine.tokenizer.stop_ids == {tokenizer.eos_id, greedy[k], first}
    stopped, empty = tokenizer.decode(greedy[:k]), ""
    with http_server(engine) as (url, _):
        assert _complete(url, {"prompt": prompts[0]}) == (stopped, "stop", k, stopped, "stop")
        assert _complete(url, {"prompt": prompts[1]}) == (empty, "stop", 0, empty, "stop")
        for prompt, text in zip(prompts, map(tokenizer.decode, (greedy, other)), strict=True):
            assert _complete(url, {"prompt": prompt, "ignore_eos": True}) == (text, "length", NEW, text, "length")
    assert engine.pool.in_use() == 0
