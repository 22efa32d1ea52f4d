"""What a structured output costs the requests it shares a batch with, measured side by side in one
process on the Llama-shaped model of `bench_serve.py` (random weights, fp32, the GPT-2 tokenizer):

1. Free requests' decode rate (7 greedy requests of `--new` tokens each) alone, and with one
   request under a JSON schema (an array of 3-digit integers, long enough to last) in the same
   batches: the ratio is the slowdown a constrained neighbour causes.
2. The constrained request's own pace: its next mask follows from its last token, so it decodes
   every other engine step. Alone it loses only the overlap of host work with the device step
   (its rate against the same request free); in a busy batch it draws a token every other step
   (its tokens while each free neighbour draws `--new`).
3. The host's mask time: llguidance's milliseconds per token for the schema, beside the decode
   step's time.

    python scripts/bench_structured.py [--hidden 512] [--layers 8] [--new 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bench_serve import SLOTS, model_config, seconds

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}, "minItems": 200,
          "maxItems": 200}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new", type=int, default=96, help="tokens each free request decodes")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax

    from jaxllm.data.tokenizer import get_tokenizer
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.serve.constraints import Grammars
    from jaxllm.serve.generation import Request
    from jaxllm.serve.load import build_engine
    from jaxllm.serve.settings import ServeConfig, serving_config
    from jaxllm.train.step import init_params

    tokenizer = get_tokenizer("gpt2")
    cfg = model_config(args.hidden, args.layers, tokenizer.vocab_size)
    settings = ServeConfig(slots=SLOTS, max_len=1024, max_prompt_tokens=512, rate_per_s=1e9, burst=10**9)
    serving = serving_config(cfg, settings, 1)
    engine = build_engine(init_params(cfg), serving, tokenizer, make_mesh(serving.parallel, jax.devices()[:1]))
    schema = Grammars(tokenizer).json_schema(SCHEMA, "schema")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tokenizer.vocab_size, 64).tolist() for _ in range(SLOTS)]
    free = [Request(p, args.new, temperature=0.0, ignore_eos=True) for p in prompts[: SLOTS - 1]]
    constrained = Request(prompts[-1], 2 * args.new + 8, temperature=0.0, constraint=schema)

    def run(requests, beside=()):
        """Steps until `requests` have finished, with `beside` in the same batches (then cancelled)."""

        def go():
            timed, others = [engine.submit(r) for r in requests], [engine.submit(r) for r in beside]
            while not all(g.done for g in timed):
                engine.step()
            drawn = [len(g.streams[0].tokens) for g in others]
            for g in others:
                g.cancel()
            while engine.busy():
                engine.step()
            return drawn

        return go

    alone = seconds(run(free), args.repeats)
    beside = seconds(run(free, [constrained]), args.repeats)
    tokens = len(free) * args.new
    own_free = seconds(run([Request(prompts[-1], args.new, temperature=0.0, ignore_eos=True)]), args.repeats)
    own_constrained = seconds(run([Request(prompts[-1], args.new, temperature=0.0, constraint=schema)]), args.repeats)

    (in_batch,) = run(free, [constrained])()
    text = engine.generate([constrained])[0].choices()[0].text
    ids, matcher = tokenizer.encode(text), schema.matcher()
    row = np.empty(engine.words, np.int32)
    start = time.perf_counter()
    for token in ids:
        matcher.fill(row)
        matcher.take(token)
    mask_ms = (time.perf_counter() - start) / len(ids) * 1e3

    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {tokenizer.vocab_size}; {SLOTS} slots; "
          f"jax {jax.__version__} on {jax.devices()[0].device_kind}")  # fmt: skip
    print(f"free requests' decode: {tokens / alone:.1f} tokens/s alone, {tokens / beside:.1f} beside a constrained "
          f"one: {alone / beside:.3f} of their rate")  # fmt: skip
    print(f"one request's own rate under the schema: {own_free / own_constrained:.3f} of the same request free; "
          f"in the busy batch it drew {in_batch} tokens while each free request drew {args.new}")  # fmt: skip
    print(f"host mask time: {mask_ms:.3f} ms a token ({len(ids)} tokens), against a decode step of "
          f"{alone / args.new * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
