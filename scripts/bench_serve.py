"""Serving benchmarks, each printed as ratios measured in one run, on a Llama-shaped model with
random weights (fp32), serve.max_len 4096:

1. Decode tokens/s at 1 and 8 busy sequences with 128 and 1024 tokens of context, against
   - the engine at an earlier commit (`--baseline`, default the one before the paged engine): a
     git worktree of it, measured by this same script in its own process;
   - Hugging Face transformers (`LlamaForCausalLM.generate`, greedy, KV cache), where installed
     (pip install -e '.[hf]');
   - the memory-bandwidth limit: (weight bytes + live cache bytes) per token over the bandwidth
     a jitted read of 256 MB reaches here, measured in the engine's process as it starts.
   Decode rate: the extra time of `new` tokens over 1 token, per token after the first.
2. A serving workload like vLLM's benchmark_serving, through HTTP (uvicorn on 127.0.0.1, streamed
   completions): a fixed seeded set of requests with Poisson arrivals at each of `--rates`,
   prompt lengths log-uniform in 16..1024 and outputs in 8..128 tokens, a third of them behind a
   common 512-token system prompt: requests/s, output tokens/s, time to first token (TTFT) and
   time per output token (TPOT) p50/p99, for this engine and the baseline.
3. Time to first token of a 512-token system prompt plus a short question, cold and with the
   system prompt's pages in the prefix cache.

    python scripts/bench_serve.py [--baseline REF] [--hidden 512] [--layers 8] [--rates 0.5 1 2]

Each engine runs in its own process, one after the other (JAX, then torch); prompts are random
token ids. The HTTP parts need httpx (the test extra).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASELINE = "53eb465"  # the last commit of the engine with one contiguous cache slot per request
MAX_LEN, SLOTS, CONTEXTS = 4096, 8, (128, 1024)
SYSTEM = 512  # tokens of the workload's common system prompt


def seconds(fn, repeats: int) -> float:
    """The median wall time of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_config(hidden: int, layers: int, vocab: int):
    from jaxllm.config import RunConfig

    heads = hidden // 64
    return RunConfig().updated(model=dict(
        num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=heads, mlp=3 * hidden, vocab_size=vocab,
        max_seq_len=MAX_LEN, qkv_share_every=4, dtype="float32",
    ))  # fmt: skip


def engine_rates(engine, prompts: np.ndarray, new: int, repeats: int, busy=(1, 8)) -> dict[str, float]:
    """Prefill seconds (one request) and decode tokens/s at each count of busy sequences."""
    from jaxllm.serve.generation import Request

    def run(count: int, tokens: int):
        requests = [Request(p.tolist(), tokens, temperature=0.0, ignore_eos=True) for p in prompts[:count]]
        return lambda: engine.generate(requests)

    out = {"prefill_s": seconds(run(1, 1), repeats)}
    for count in busy:
        extra = seconds(run(count, new), repeats) - seconds(run(count, 1), repeats)
        out[f"decode_{count}"] = count * (new - 1) / extra
    return out


def matmul_rows(hidden: int, vocab: int) -> dict[str, float]:
    """Seconds of a jitted [rows, hidden] × [hidden, 2 × vocab] fp32 product, at 1 and 8 rows:
    what reading the same weights for 8 sequences instead of 1 costs XLA here."""
    import jax
    import jax.numpy as jnp

    w = jnp.ones((hidden, 2 * vocab), jnp.float32)
    product = jax.jit(lambda x, w: x @ w)
    out = {"bytes": w.nbytes}
    for rows in (1, 8):
        x = jnp.ones((rows, hidden), jnp.float32)
        out[str(rows)] = seconds(lambda x=x: jax.block_until_ready(product(x, w)), 10)
    return out


# ---- one engine, in its own process (this engine, or a worktree's) ----


def build_engine(args, settings: dict):
    import jax

    from jaxllm.data.tokenizer import get_tokenizer
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.serve.settings import ServeConfig, serving_config
    from jaxllm.train.step import init_params

    try:
        from jaxllm.serve.load import build_engine as engine_of  # the engine over a device runner
    except ImportError:
        from jaxllm.serve.engine import Engine as engine_of  # a baseline from before the split

    tokenizer = get_tokenizer("gpt2")
    cfg = model_config(args.hidden, args.layers, tokenizer.vocab_size)
    known = {k: v for k, v in settings.items() if k in ServeConfig.__dataclass_fields__}  # a baseline lacks some
    serving = serving_config(cfg, ServeConfig(**known), 1)
    return engine_of(init_params(cfg), serving, tokenizer, make_mesh(serving.parallel, jax.devices()[:1])), cfg


def bandwidth(engine) -> float | None:
    """Bytes/s of this machine's memory, as the engine's runner measured it before it started (a
    baseline's engine has no runner, and only this engine's figure is used)."""
    return engine.device.bandwidth if hasattr(engine, "device") else None


def worker(args) -> dict:
    import jax

    import jaxllm

    assert pathlib.Path(jaxllm.__file__).resolve().is_relative_to(pathlib.Path(args.source).resolve()), jaxllm.__file__
    settings = dict(slots=SLOTS, max_len=MAX_LEN, max_prompt_tokens=2048, rate_per_s=1e9, burst=10**9, max_queue=512)
    start = time.perf_counter()
    engine, cfg = build_engine(args, settings)
    out = {"startup_s": time.perf_counter() - start, "jax": jax.__version__, "bandwidth": bandwidth(engine),
           "matmul": matmul_rows(args.hidden, engine.vocab_size)}  # fmt: skip
    rng = np.random.default_rng(0)
    for context in CONTEXTS:
        prompts = rng.integers(0, engine.vocab_size, (SLOTS, context))
        out[f"context_{context}"] = engine_rates(engine, prompts, args.new, args.repeats)
    out["workload"] = {str(rate): asyncio.run(serve_workload(engine, rate, args.requests)) for rate in args.rates}
    out["cached_prefix"] = asyncio.run(serve_cached_prefix(engine))
    return out


def workload(rate: float, count: int, vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt, output tokens) of `count` requests at `rate` a second, fixed by the seed."""
    rng = np.random.default_rng(7)
    system = rng.integers(0, vocab, SYSTEM).tolist()
    arrivals = np.cumsum(rng.exponential(1 / rate, count))
    lengths = np.exp(rng.uniform(np.log(16), np.log(1024), count)).astype(int)
    outputs = rng.integers(8, 129, count)
    requests = []
    for r in range(count):
        prompt = rng.integers(0, vocab, lengths[r]).tolist()
        if r % 3 == 0:
            prompt = system + prompt[: 1024 - SYSTEM]
        requests.append((float(arrivals[r]), prompt, int(outputs[r])))
    return requests


@contextlib.asynccontextmanager
async def http_server(engine):
    """The HTTP app on `engine` (uvicorn on 127.0.0.1), the engine stepping in its own thread."""
    import uvicorn

    from jaxllm.data.chat import ChatTemplate
    from jaxllm.serve.api import create_app
    from jaxllm.serve.guards import DenyList
    from jaxllm.serve.metrics import Metrics
    from jaxllm.serve.server import Server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Server(engine.settings, engine.limits, "bench", engine.tokenizer, ChatTemplate(), DenyList([]),
                    frozenset(), Metrics(engine.slots, "bench"), engine)  # fmt: skip
    http = uvicorn.Server(uvicorn.Config(create_app(server), "127.0.0.1", port, log_level="warning"))
    stop = threading.Event()
    threads = [threading.Thread(target=http.run), threading.Thread(target=engine.serve_forever, args=(stop,))]
    for t in threads:
        t.start()
    while not http.started:
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        http.should_exit = True
        for t in threads:
            t.join()


async def stream(client, prompt: list[int], tokens: int) -> tuple[float, float, int]:
    """One streamed greedy completion: (seconds to its first token, to its end, tokens received)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start, first, received = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter() - start
                received += 1
    return first, time.perf_counter() - start, received


async def serve_workload(engine, rate: float, count: int) -> dict[str, float]:
    import httpx

    requests = workload(rate, count, engine.vocab_size)
    async with http_server(engine) as url, httpx.AsyncClient(base_url=url, timeout=3600) as client:
        await stream(client, requests[0][1][:16], 2)  # warm-up

        async def send(arrival, prompt, tokens):
            await asyncio.sleep(arrival)
            return await stream(client, prompt, tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(send(*r) for r in requests))
        wall = time.perf_counter() - start
    ttft = [first for first, _, _ in results]
    tpot = [(end - first) / (n - 1) for first, end, n in results if n > 1]
    out = {"requests_s": count / wall, "output_tok_s": sum(n for _, _, n in results) / wall}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        out[f"{name}_p50"], out[f"{name}_p99"] = np.percentile(values, [50, 99]).tolist()
    return out


async def serve_cached_prefix(engine) -> dict[str, float]:
    """TTFT of the system prompt and a 16-token question: the first time (cold), then with
    another question (the system prompt's pages cached, if the engine caches them)."""
    import httpx

    rng = np.random.default_rng(11)
    system = rng.integers(0, engine.vocab_size, SYSTEM).tolist()
    async with http_server(engine) as url, httpx.AsyncClient(base_url=url, timeout=600) as client:
        cold = (await stream(client, system + rng.integers(0, engine.vocab_size, 16).tolist(), 2))[0]
        warm = [
            (await stream(client, system + rng.integers(0, engine.vocab_size, 16).tolist(), 2))[0] for _ in range(5)
        ]
    return {"cold_s": cold, "warm_s": statistics.median(warm)}


# ---- the run: every engine, then transformers, then the table ----


def run_worker(args, source: pathlib.Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source)}
    command = [sys.executable, __file__, "--worker", "--source", str(source), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--new", str(args.new), "--repeats", str(args.repeats),
               "--requests", str(args.requests), "--rates", *map(str, args.rates)]  # fmt: skip
    out = subprocess.run(command, env=env, cwd=source, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"the engine at {source} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def worktree(ref: str):
    with tempfile.TemporaryDirectory() as scratch:
        path = pathlib.Path(scratch) / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT, check=True, capture_output=True
        )
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=True)


def transformers_rates(args, vocab: int) -> tuple[dict, str] | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    heads = args.hidden // 64
    llama = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(llama).eval()
    out, rng = {}, np.random.default_rng(0)
    for context in CONTEXTS:
        prompts = rng.integers(0, vocab, (SLOTS, context))

        def run(count: int, tokens: int, prompts=prompts):
            ids = torch.as_tensor(prompts[:count], dtype=torch.long)
            settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)

            def generate():
                with torch.inference_mode():
                    model.generate(ids, attention_mask=torch.ones_like(ids), **settings)

            return generate

        rates = {"prefill_s": seconds(run(1, 1), args.repeats)}
        for count in (1, 8):
            extra = seconds(run(count, args.new), args.repeats) - seconds(run(count, 1), args.repeats)
            rates[f"decode_{count}"] = count * (args.new - 1) / extra
        out[f"context_{context}"] = rates
    return (
        out,
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}",
    )


def bandwidth_limits(args, vocab: int, bandwidth: float) -> dict[str, float]:
    """Tokens/s at 1 sequence if each token only read the weights and its live cache once, at
    `bandwidth` bytes/s (the planner's decode limit, fp32 weights and cache)."""
    from jaxllm import plan

    cfg = model_config(args.hidden, args.layers, vocab)
    limit = partial(plan.decode_limit, cfg.model, 1, bandwidth=bandwidth, weights="fp32", kv="fp32")
    return {f"context_{c}": limit(c) for c in CONTEXTS} | {"bandwidth": bandwidth}


def report(args, new: dict, old: dict, hf, limits: dict) -> None:
    print(f"jax {new['jax']}; Llama-shaped, {args.layers} layers, hidden {args.hidden}, fp32, serve.max_len {MAX_LEN}, "
          f"{SLOTS} slots; copy bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s")  # fmt: skip
    print(f"start-up (compiling every step): this engine {new['startup_s']:.0f} s, baseline {old['startup_s']:.0f} s")
    print(f"\ndecode tokens/s ({args.new} new tokens, greedy)")
    print(f"  {'context':>8}{'busy':>6}{'engine':>9}{'baseline':>10}{'× base':>8}{'transformers':>14}{'× hf':>7}"
          f"{'limit':>8}{'of limit':>10}")  # fmt: skip
    for context in CONTEXTS:
        key = f"context_{context}"
        for busy in (1, 8):
            rate, base = new[key][f"decode_{busy}"], old[key][f"decode_{busy}"]
            hf_rate = hf[0][key][f"decode_{busy}"] if hf else None
            limit = limits[key] if busy == 1 else None
            print(f"  {context:>8}{busy:>6}{rate:>9.1f}{base:>10.1f}{rate / base:>7.1f}×"
                  + (f"{hf_rate:>14.1f}{rate / hf_rate:>6.1f}×" if hf else f"{'-':>14}{'-':>7}")
                  + (f"{limit:>8.1f}{rate / limit:>10.2f}" if limit else f"{'-':>8}{'-':>10}"))  # fmt: skip
    print(f"  transformers: {hf[1]}" if hf else "  transformers: not installed (pip install -e '.[hf]'), not compared")
    m = new["matmul"]
    print(f"  XLA's [rows, {args.hidden}] × [{args.hidden}, {m['bytes'] // (4 * args.hidden)}] fp32 product "
          f"({m['bytes'] / 1e6:.0f} MB of weights): 1 row {m['1'] * 1e3:.1f} ms, 8 rows {m['8'] * 1e3:.1f} ms "
          f"({m['8'] / m['1']:.1f}×)")  # fmt: skip
    print(f"\nworkload through HTTP ({args.requests} requests a rate; Poisson arrivals; prompts 16..1024 tokens, "
          f"a third behind one {SYSTEM}-token system prompt; outputs 8..128)")  # fmt: skip
    print(
        f"  {'rate/s':>7} {'engine':<9}{'req/s':>7}{'out tok/s':>10}{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}{'p99':>7}"
    )
    for rate in map(str, args.rates):
        for name, r in (("engine", new["workload"][rate]), ("baseline", old["workload"][rate])):
            print(f"  {rate:>7} {name:<9}{r['requests_s']:>7.2f}{r['output_tok_s']:>10.1f}{r['ttft_p50']:>9.2f}"
                  f"{r['ttft_p99']:>7.2f}{r['tpot_p50']:>9.3f}{r['tpot_p99']:>7.3f}")  # fmt: skip
        n, o = new["workload"][rate], old["workload"][rate]
        ratios = [n[k] / o[k] for k in ("requests_s", "output_tok_s", "ttft_p50", "ttft_p99")]
        print(f"  {'':>7} ratio    {ratios[0]:>6.2f}×{ratios[1]:>9.2f}×{ratios[2]:>8.2f}×{ratios[3]:>6.2f}×")
    for name, r in (("engine", new["cached_prefix"]), ("baseline", old["cached_prefix"])):
        print(f"\n{name}: TTFT of a {SYSTEM}-token system prompt + 16 tokens: cold {r['cold_s']:.3f} s, its pages "
              f"cached {r['warm_s']:.3f} s ({r['warm_s'] / r['cold_s']:.2f} of cold)", end="")  # fmt: skip
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="the git commit whose engine to compare with")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new", type=int, default=32, help="tokens generated per request in the decode benchmark")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="requests per arrival rate")
    parser.add_argument("--rates", type=float, nargs="*", default=[0.5, 1.0, 2.0], help="none: no HTTP workload")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--source", default=str(ROOT), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    new = run_worker(args, ROOT)
    with worktree(args.baseline) as path:
        old = run_worker(args, path)
    from jaxllm.data.tokenizer import get_tokenizer

    vocab = get_tokenizer("gpt2").vocab_size
    report(args, new, old, transformers_rates(args, vocab), bandwidth_limits(args, vocab, new["bandwidth"]))


if __name__ == "__main__":
    main()
