"""Speculative decoding by prompt lookup (serve.speculative=ngram), or by a draft model
(`--draft`: serve.speculative=draft), against plain decoding, at one busy sequence (four with
`--together`), side by side in one process, on a trained run (`--workdir`, e.g. the
Quickstart's, whose model learnt the Python standard library's sources) or, without one, on
`bench_serve.py`'s Llama-shaped model (random weights, GPT-2 tokenizer), whose decode step is
bound by reading its weights as a large model's is (its greedy text repeats itself rather than
its prompt):

1. code continuation: the opening of standard-library modules, continued greedily;
2. summarisation-style: a passage of the library's documentation, then "In short," and a
   greedy continuation, which quotes the passage where it can;
3. nothing repeats: prompts of random tokens, sampled at temperature 1, whose output repeats
   neither the prompt nor itself.

Each line is the two engines' tokens/s over the same requests (the median of --repeats runs after
a warm-up, the engines' runs taking turns so that the machine's drift falls on both), their
ratio, the fraction of proposed tokens the model accepted and of output tokens that came from
verify steps; then the same for the speculating engine with serve.speculative_auto off (it
verifies wherever there are drafts, faster or not). With prompt lookup it also gives the ratio
against the speculating engine's own plain steps (the same engine with serve.speculative set to
off between runs): its buffers and executables are the speculating runs' own, where two engines
of the same compiled steps may step at paces 10 % or more apart on this machine. (A draft
model's engine runs the draft in its plain steps too, so only the plain engine is its baseline.)

With `--together` a kind's four requests decode at once, four busy sequences whose verify steps
and back-offs fall in each other's steps; `--max-batch N` sets serve.speculative_max_batch (prompt
lookup only while at most N sequences decode).

    python scripts/bench_speculative.py [--workdir runs/tiny [--draft runs/tiny-draft]] [--new 128] [--repeats 3]
        [--draft-tokens 8] [--ngram 2 4] [--together [--max-batch 2]]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import re
import statistics
import time

import numpy as np
from bench_serve import model_config

MODULES = ("textwrap", "shlex", "fnmatch", "colorsys")


def _source(module: str) -> str:
    return pathlib.Path(importlib.util.find_spec(module).origin).read_text()


def prompt_sets(tokenizer, prompt_tokens: int) -> dict[str, list[tuple[list[int], float]]]:
    """(prompt, temperature) for each kind of text."""
    code = [tokenizer.encode(_source(m))[-prompt_tokens * 3 : -prompt_tokens * 2] for m in MODULES]
    docs = [re.search(r'"""(.*?)"""', _source(m), re.S).group(1) for m in MODULES]
    summaries = [tokenizer.encode(d)[: prompt_tokens - 8] + tokenizer.encode("\n\nIn short, ") for d in docs]
    rng = np.random.default_rng(0)
    random = [rng.integers(0, tokenizer.vocab_size, prompt_tokens).tolist() for _ in MODULES]
    return {
        "code continuation": [(p, 0.0) for p in code],
        "summarisation-style": [(p, 0.0) for p in summaries],
        "nothing repeats": [(p, 1.0) for p in random],
    }


def _speculated(runs: list, column: int, tokens: int) -> str:
    """What the engine of `column` proposed and accepted over `runs` (each `tokens` output tokens)."""
    drafts, drafted, accepted = sum(counts for _, counts in (r[column] for r in runs))
    verified = (drafts + accepted) / (tokens * len(runs))  # each verify step: its accepted tokens and one
    return f"{accepted / max(drafted, 1):.2f} of proposed tokens accepted, {verified:.2f} of tokens from verify steps"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="a training run (the Quickstart's: runs/tiny); default: random weights")
    parser.add_argument("--new", type=int, default=128, help="tokens each request decodes")
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--draft", help="with --workdir: a smaller run of the same tokenizer to draft with")
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ngram", type=int, nargs=2, metavar=("MIN", "MAX"), help="serve.ngram_min and ngram_max")
    parser.add_argument("--together", action="store_true", help="a kind's requests at once, not one at a time")
    parser.add_argument("--max-batch", type=int, default=0, help="serve.speculative_max_batch (prompt lookup)")
    args = parser.parse_args()

    import jax

    from jaxllm.data.tokenizer import get_tokenizer
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.serve.generation import Request
    from jaxllm.serve.load import build_engine, load_engine
    from jaxllm.serve.settings import ServeConfig, serving_config
    from jaxllm.serve.speculation import Pace
    from jaxllm.train.step import init_params

    settings = {"slots": 4, "max_len": args.prompt_tokens + args.new + 8}
    speculation = {"speculative": "ngram", "draft_tokens": args.draft_tokens, "speculative_max_batch": args.max_batch}
    if args.ngram:
        speculation.update(ngram_min=args.ngram[0], ngram_max=args.ngram[1])
    if args.draft:
        if not args.workdir:
            parser.error("--draft drafts for a trained run: pass --workdir too")
        speculation.update(speculative="draft", draft_model=args.draft)
    proposer = speculation["speculative"]
    if args.workdir:
        plain = load_engine(args.workdir, {f"serve.{k}": v for k, v in settings.items()})
        speculative = load_engine(args.workdir, {f"serve.{k}": v for k, v in {**settings, **speculation}.items()})
    else:
        tokenizer = get_tokenizer("gpt2")
        cfg = model_config(512, 8, tokenizer.vocab_size)
        params = init_params(cfg)

        def engine(**serve):
            serving = serving_config(cfg, ServeConfig(**serve), 1)
            return build_engine(params, serving, tokenizer, make_mesh(serving.parallel, jax.devices()[:1]))

        plain, speculative = engine(**settings), engine(**settings, **speculation)
    speculating = speculative.settings
    # Prompt lookup's engine decodes plain steps too (a plain engine's, with the lookup's flag):
    # the same engine with speculation off is a baseline of the same buffers and executables.
    own_plain = None if args.draft else dataclasses.replace(speculating, speculative="off")
    always = dataclasses.replace(speculating, speculative_auto=False)
    # Each setting of the speculating engine learns its own pace over its runs, as a server would.
    paces = {id(settings): Pace(args.draft_tokens) for settings in (speculating, always, own_plain)}
    ngram = f"ngram {speculative.settings.ngram_min}..{speculative.settings.ngram_max}"
    how = f"draft model {args.draft}" if args.draft else ngram
    at_once = "all of a kind's requests at once" if args.together else "one request at a time"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.new} new tokens a request, {at_once}; "
          f"{how}, {args.draft_tokens} draft tokens")  # fmt: skip
    for kind, prompts in prompt_sets(speculative.tokenizer, args.prompt_tokens).items():
        requests = [Request(p, args.new, temperature=t, seed=i, ignore_eos=True) for i, (p, t) in enumerate(prompts)]

        def run(engine, settings=None, requests=requests) -> tuple[float, np.ndarray]:
            """(seconds, the drafts verified, tokens proposed and tokens accepted meanwhile)"""
            engine.settings = settings or engine.settings
            engine.pace = paces.setdefault(id(engine.settings), engine.pace)
            counts = np.array([engine.drafts, engine.draft_tokens, engine.accepted_tokens])
            start = time.perf_counter()
            for batch in [requests] if args.together else [[r] for r in requests]:
                engine.generate(batch)
            elapsed = time.perf_counter() - start
            return elapsed, np.array([engine.drafts, engine.draft_tokens, engine.accepted_tokens]) - counts

        engines = [(plain, None), (speculative, speculating), (speculative, always)]
        engines += [(speculative, own_plain)] * bool(own_plain)
        runs = [[run(*e) for e in engines] for _ in range(args.repeats + 1)]  # the first a warm-up
        base, fast, fixed, *own = (statistics.median(seconds for seconds, _ in r[1:]) for r in zip(*runs, strict=True))
        tokens = len(requests) * args.new

        own = f" ({own[0] / fast:.2f}x its own engine's plain steps')" if own else ""
        print(f"{kind:>20}: plain {tokens / base:6.1f} tokens/s, {proposer} {tokens / fast:6.1f} tokens/s: "
              f"{base / fast:.2f}x{own}; {_speculated(runs, 1, tokens)}; always verifying {base / fixed:.2f}x, "
              f"{_speculated(runs, 2, tokens)}")  # fmt: skip


if __name__ == "__main__":
    main()
