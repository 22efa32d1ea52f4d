"""The serving engine against a full recompute and Hugging Face transformers, in one process, on
the same Llama-shaped model with random weights (fp32): decode tokens/s at 1 and 8 busy slots,
and prefill time, at two context lengths; then the same engine end to end through HTTP.

    python scripts/bench_serve.py [--contexts 128 512] [--new 32] [--hidden 512] [--layers 8]

- engine: `Engine.generate` (prefill, insert, decode steps, sampling, detokenizing). Decode rate:
  the extra time of `new` tokens over 1 token, per token after the first.
- full recompute: one jitted forward over the whole context per token, no cache (what decoding
  costs without one), at the same context.
- transformers: `LlamaForCausalLM.generate` (greedy, KV cache) on torch CPU, measured the same way
  as the engine; skipped unless torch and transformers are installed.

- HTTP: the server (`jaxllm.serve.api`, uvicorn on 127.0.0.1) stepping the same engine in its
  thread, and 1 or 8 clients in threads, each streaming completions of `new` tokens one after
  another: generated tokens/s over the wall time, and time to the first streamed token (p50,
  p90); beside it, `Engine.generate` of the same requests in the same process, with no HTTP.

Both frameworks use all of this machine's cores, one after the other (JAX for every context, then
torch); the prompt is random token ids.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import uvicorn

from jaxllm import plan
from jaxllm.config import RunConfig
from jaxllm.data.tokenizer import get_tokenizer
from jaxllm.model.decoder import Model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.serve.api import create_app
from jaxllm.serve.chat import ChatTemplate
from jaxllm.serve.engine import Engine
from jaxllm.serve.generation import Request
from jaxllm.serve.guards import DenyList
from jaxllm.serve.metrics import Metrics
from jaxllm.serve.server import Server
from jaxllm.serve.settings import ServeConfig, serving_config
from jaxllm.train.step import init_params


def seconds(fn, repeats: int) -> float:
    """The median wall time of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_config(args, vocab: int, max_len: int) -> RunConfig:
    heads = args.hidden // 64
    return RunConfig().updated(model=dict(
        num_layers=args.layers, hidden=args.hidden, num_heads=heads, num_kv_heads=heads, mlp=3 * args.hidden,
        vocab_size=vocab, max_seq_len=max_len, qkv_share_every=4, dtype="float32",
    ))  # fmt: skip


def engine_rates(engine: Engine, prompts: np.ndarray, new: int, repeats: int) -> dict[str, float]:
    """Prefill seconds (one request) and decode tokens/s at each slot count."""

    def run(slots: int, tokens: int):
        requests = [Request(p.tolist(), tokens, temperature=0.0, ignore_eos=True) for p in prompts[:slots]]
        return lambda: engine.generate(requests)

    out = {"prefill_s": seconds(run(1, 1), repeats)}
    for slots in (1, 8):
        extra = seconds(run(slots, new), repeats) - seconds(run(slots, 1), repeats)
        out[f"decode_{slots}"] = slots * (new - 1) / extra
    return out


def stream_completion(port: int, prompt: list[int], new: int) -> tuple[float, float]:
    """Streams one greedy completion; (seconds to its first token, seconds to its end)."""
    start, first = time.perf_counter(), None
    connection = http.client.HTTPConnection("127.0.0.1", port)
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    for line in response:
        if line.startswith(b"data: {") and first is None:
            first = time.perf_counter() - start
    connection.close()
    return first, time.perf_counter() - start


def http_rates(engine: Engine, prompts: np.ndarray, new: int, rounds: int) -> dict[str, dict[str, float]]:
    """Tokens/s and time to first token through HTTP at 1 and 8 concurrent clients, and the
    tokens/s of `Engine.generate` for the same requests without HTTP."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = Metrics(engine.slots)
    server = Server(engine.settings, engine.limits, "bench", engine.tokenizer, ChatTemplate(), DenyList([]),
                    frozenset(), metrics, engine)  # fmt: skip
    http = uvicorn.Server(uvicorn.Config(create_app(server), "127.0.0.1", port, log_level="warning"))
    stop = threading.Event()
    threads = [threading.Thread(target=http.run), threading.Thread(target=engine.serve_forever, args=(stop,))]
    for t in threads:
        t.start()
    while not http.started:
        time.sleep(0.05)
    out = {}
    for clients in (1, 8):
        firsts = []

        def client(prompt, firsts=firsts):
            for _ in range(rounds):
                firsts.append(stream_completion(port, prompt, new)[0])

        stream_completion(port, prompts[0].tolist(), new)  # warm-up
        start = time.perf_counter()
        workers = [threading.Thread(target=client, args=(p.tolist(),)) for p in prompts[:clients]]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - start
        p50, p90 = np.percentile(firsts, [50, 90])
        out[clients] = {"tok_s": clients * rounds * new / wall, "ttft_p50": p50, "ttft_p90": p90}
    stop.set()
    http.should_exit = True
    for t in threads:
        t.join()
    for clients in (1, 8):
        requests = [Request(p.tolist(), new, temperature=0.0, ignore_eos=True) for p in prompts[:clients]]
        out[clients]["engine_tok_s"] = clients * new / seconds(lambda r=requests: engine.generate(r), rounds)
    return out


def recompute_rates(cfg, params, prompts: np.ndarray, repeats: int) -> dict[str, float]:
    """Tokens/s when every token is a forward pass over the whole context."""
    step = jax.jit(lambda p, t: jnp.argmax(Model(cfg.model).logits(p, t)[:, -1], -1))
    out = {}
    for slots in (1, 8):
        tokens = jnp.asarray(prompts[:slots])
        out[f"decode_{slots}"] = slots / seconds(lambda t=tokens: jax.block_until_ready(step(params, t)), repeats)
    return out


def transformers_rates(cfg, prompts: np.ndarray, new: int, repeats: int) -> tuple[dict[str, float], str] | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    m = cfg.model
    llama = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.mlp, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(llama).eval()

    def run(slots: int, tokens: int):
        ids = torch.as_tensor(prompts[:slots], dtype=torch.long)
        settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)

        def generate():
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), **settings)

        return generate

    out = {"prefill_s": seconds(run(1, 1), repeats)}
    for slots in (1, 8):
        extra = seconds(run(slots, new), repeats) - seconds(run(slots, 1), repeats)
        out[f"decode_{slots}"] = slots * (new - 1) / extra
    versions = (
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters (a QKV per layer)"
    )
    return out, versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--new", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = get_tokenizer("gpt2")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; Llama-shaped: {args.layers} layers, hidden "
          f"{args.hidden}, {args.hidden // 64} heads, mlp {3 * args.hidden}, vocab {tokenizer.vocab_size}; fp32; "
          f"{args.new} new tokens, greedy")  # fmt: skip
    # JAX first, for every context, and torch only then: torch's idle worker threads keep
    # spinning for a while after each call and would slow whatever runs beside them.
    results, configs, served = {}, {}, {}
    for context in args.contexts:
        cfg = model_config(args, tokenizer.vocab_size, context + args.new)
        unlimited = ServeConfig(max_prompt_tokens=context, rate_per_s=1e9, burst=10**9)
        configs[context] = serving_config(cfg, unlimited, 1)
        params = init_params(cfg)
        engine = Engine(params, configs[context], tokenizer, make_mesh(configs[context].parallel, jax.devices()[:1]))
        prompts = np.random.default_rng(0).integers(0, tokenizer.vocab_size, (8, context))
        results[context] = {
            "engine": engine_rates(engine, prompts, args.new, args.repeats),
            "full recompute": recompute_rates(configs[context], params, prompts, args.repeats),
        }
        served[context] = http_rates(engine, prompts, args.new, args.repeats)
    print(f"jaxllm: {plan.param_counts(cfg.model)['total'] / 1e6:.1f}M parameters (a QKV per 4 layers)")
    for context in args.contexts:
        prompts = np.random.default_rng(0).integers(0, tokenizer.vocab_size, (8, context))
        hf = transformers_rates(configs[context], prompts, args.new, args.repeats)
        if hf is None:
            print("transformers: not installed (pip install -e '.[hf]'), so not compared")
            break
        results[context]["transformers"], versions = hf
    else:
        print(versions)
    for context, rows in results.items():
        print(f"\ncontext {context} tokens (serve.max_len {configs[context].settings.max_len}):")
        print(f"  {'':16}{'prefill s':>10}{'1 slot tok/s':>14}{'8 slots tok/s':>15}")
        for name, r in rows.items():
            prefill = f"{r['prefill_s']:.3f}" if "prefill_s" in r else "-"
            print(f"  {name:16}{prefill:>10}{r['decode_1']:>14.1f}{r['decode_8']:>15.1f}")
        for name in [n for n in rows if n != "engine"]:
            ratios = [rows["engine"][f"decode_{s}"] / rows[name][f"decode_{s}"] for s in (1, 8)]
            print(f"  engine / {name}: {ratios[0]:.1f}× at 1 slot, {ratios[1]:.1f}× at 8 slots")
        print(f"  through HTTP, streamed ({args.repeats} requests per client, one after another):")
        print(f"  {'':16}{'tok/s':>10}{'TTFT p50 s':>12}{'TTFT p90 s':>12}"
              f"{'Engine.generate tok/s':>23}{'HTTP / engine':>15}")  # fmt: skip
        for clients, r in served[context].items():
            name = f"{clients} client" + "s" * (clients > 1)
            print(f"  {name:16}{r['tok_s']:>10.1f}{r['ttft_p50']:>12.3f}{r['ttft_p90']:>12.3f}"
                  f"{r['engine_tok_s']:>23.1f}{r['tok_s'] / r['engine_tok_s']:>14.2f}×")  # fmt: skip


if __name__ == "__main__":
    main()
