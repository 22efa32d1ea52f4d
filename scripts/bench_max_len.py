"""What serve.max_len costs a short request: one streamed-length request (a short prompt, greedy)
decoded by engines over the same run at serve.max_len 256 and 4096 (model.max_seq_len raised to
match), in one process, their runs taking turns. Prints each engine's milliseconds per token and
the ratio (1 would be a cost that does not grow with serve.max_len at all).

    python scripts/bench_max_len.py --workdir runs/tiny [--new 96] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="a training run (the Quickstart's: runs/tiny)")
    parser.add_argument("--new", type=int, default=96, help="tokens the request decodes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from jaxllm.serve.generation import Request
    from jaxllm.serve.load import load_engine

    engines = {
        max_len: load_engine(args.workdir, {"serve.max_len": max_len, "model.max_seq_len": 4096, "serve.slots": 8})
        for max_len in (256, 4096)
    }
    prompt = engines[256].tokenizer.encode("def read_config(path):\n    ")
    request = Request(prompt, args.new, temperature=0.0, ignore_eos=True)

    def per_token(engine) -> float:
        start = time.perf_counter()
        engine.generate([request])
        return (time.perf_counter() - start) / args.new

    times = {n: [] for n in engines}
    for _ in range(args.repeats + 1):  # the first of each is a warm-up
        for n, engine in engines.items():
            times[n].append(per_token(engine))
    short, long = (statistics.median(times[n][1:]) for n in (256, 4096))
    print(f"one request, {len(prompt)} prompt tokens, {args.new} new: {short * 1e3:.2f} ms a token at serve.max_len "
          f"256, {long * 1e3:.2f} ms at 4096: 256's time is {short / long:.2f} of 4096's")  # fmt: skip


if __name__ == "__main__":
    main()
