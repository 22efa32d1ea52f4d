"""scripts/distill_draft.py: the draft's corpus is the served model's own greedy continuations of
prompts from its training text, none from the files left out, and the draft it trains (with the
served model's tokenizer) drafts for it, greedy output equal to plain decoding."""

import importlib.util
import json
import sys

import pytest
from support.runs import ROOT, XLA_CACHE, run

from jaxllm.data.corpus import read_documents, resolve_inputs
from jaxllm.serve.generation import Request
from jaxllm.serve.load import load_engine

pytestmark = pytest.mark.minutes(1)

SCRIPT = ROOT / "scripts" / "distill_draft.py"
PROMPTS, NEW = 24, 8
SERVE = {"serve.slots": 4, "serve.max_len": 64, "serve.dtype": "float32"}


def _script():
    spec = importlib.util.spec_from_file_location("distill_draft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_distilled_corpus_is_the_served_models_greedy_text_and_its_draft_drafts_for_it(trained, tmp_path):
    target, _, tokenizer = trained
    draft = tmp_path / "draft"
    shrink = ["--config.train.steps=2", "--config.train.seq_len=32", "--config.train.batch_size=4",
              "--config.data.eval_every=2", "--config.data.eval_batches=1", "--config.train.sample_tokens=4",
              "--config.model.hidden=32", "--config.model.num_heads=2", "--config.model.mlp=64",
              f"--config.train.compile_cache={XLA_CACHE}"]  # fmt: skip
    command = [sys.executable, str(SCRIPT), "--target", str(target), "--workdir", str(draft),
               "--prompts", str(PROMPTS), "--new", str(NEW), "--exclude", "textwrap", *shrink]  # fmt: skip
    run(command, devices=1)

    # The corpus: each prompt (the script's own windows, recomputed) and the target's greedy continuation.
    windows = _script().prompts(target, tokenizer, PROMPTS, 64 - NEW, {"textwrap"})
    corpus = [json.loads(line)["text"] for line in (draft / "distilled.jsonl").read_text().splitlines()]
    plain = load_engine(target, SERVE)
    greedy = plain.generate([Request(w, NEW, temperature=0.0, ignore_eos=True) for w in windows[:4]])
    assert len(corpus) == len(windows) > 0
    assert corpus[:4] == [tokenizer.decode(w + g.choices()[0].tokens) for w, g in zip(windows, greedy, strict=False)]

    # --exclude: with every file but textwrap left out, every window is a slice of textwrap's tokens.
    files = resolve_inputs(["stdlib"])
    kept = next(f for f in files if f.stem == "textwrap")
    only = _script().prompts(target, tokenizer, 8, 64 - NEW, {f.stem for f in files} - {"textwrap"})
    text = tokenizer.encode(next(t for _, t in read_documents(kept)))
    assert only and all(any(text[i : i + len(w)] == w for i in range(len(text))) for w in only)

    # The draft has the target's tokenizer, so the target serves with it.
    speculative = load_engine(target, {**SERVE, "serve.speculative": "draft", "serve.draft_model": str(draft),
                                       "serve.draft_tokens": 3})  # fmt: skip
    requests = [Request(w, NEW, temperature=0.0, ignore_eos=True) for w in windows[:4]]
    assert [g.choices()[0].tokens for g in speculative.generate(requests)] == [g.choices()[0].tokens for g in greedy]
    assert speculative.draft_tokens > 0
