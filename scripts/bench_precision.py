"""The precision table, measured in one run: the tiny model trained on the stdlib corpus in fp32,
bf16 and fp8, and the bf16 run served in bf16, int8 weights, and int8 weights with an int8 KV
cache. Per row: validation perplexity, per-device memory and decode tokens/s.

    python scripts/bench_precision.py [--config configs/tiny.py] [--steps N] [--workdir runs/precision]

- perplexity: the same validation windows for every row (those the training run evaluates on).
  Training rows: the model's forward in its training precision. Serving rows: the forward as a
  server computes it, through a KV cache of the row's dtype.
- memory, from the compiler's `memory_analysis` for one device: the state a step takes (params,
  optimizer state and batch for training rows; params and KV cache for serving rows) and the
  peak (that, outputs and temporaries, as `--dry-run` counts them) of the train step, or of the
  engine's decode step.
- decode tokens/s: `Engine.generate` at 8 busy slots (median of 3), each training row served in
  its compute dtype (fp8 runs serve in bf16). On a CPU, int8 and fp8 are emulated and bf16 has
  no native matmul: their speed is not a GPU's.

Runs already in `--workdir` resume (a finished one is kept as it is), so a second invocation
measures again without training again; all rows are measured after all training.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from bench_serve import engine_rates  # beside this script

from jaxllm import plan
from jaxllm.checkpoint import load_params
from jaxllm.config import load_config
from jaxllm.data.dataset import prepare_data
from jaxllm.data.loader import eval_batches
from jaxllm.model.cache import KVCache
from jaxllm.model.decoder import Model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.serve.load import load_engine, serving_setup
from jaxllm.train.dry_run import peak_bytes
from jaxllm.train.loop import train
from jaxllm.train.run import batch_sharding, build_run
from jaxllm.train.step import compile_train_step

TRAINING = {
    "fp32": {"model.dtype": "float32"},
    "bf16": {"model.dtype": "bfloat16"},
    "fp8": {"model.dtype": "bfloat16", "model.fp8.enabled": True},
}
SERVING = {
    "bf16": {"serve.dtype": "bfloat16"},
    "int8": {"serve.dtype": "bfloat16", "model.quantize": "int8"},
    "int8 + int8 KV": {"serve.dtype": "bfloat16", "model.quantize": "int8", "serve.kv_dtype": "int8"},
}
SERVE = {"serve.slots": 8, "serve.max_len": 256, "serve.max_prompt_tokens": 64}


def perplexity(params, model, batches, kv_dtype=None) -> float:
    """exp(mean next-token loss) over `batches`, each window read as one causal text (a cache has
    no document boundaries); with `kv_dtype`, through a KV cache of it."""

    @jax.jit
    def sums(params, batch):
        inputs = batch["inputs"]
        if kv_dtype is None:
            logits = Model(model).logits(params, inputs)
        else:
            logits, _ = Model(model).prefill(params, inputs, KVCache.empty(model, *inputs.shape, kv_dtype))
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
        return nll.sum(), nll.size

    total = [sums(params, b) for b in batches]
    return math.exp(sum(float(t) for t, _ in total) / sum(float(n) for _, n in total))


def footprint(compiled) -> tuple[int, int]:
    """(argument bytes, peak bytes) of a compiled step on one device."""
    memory = compiled.memory_analysis()
    return memory.argument_size_in_bytes, peak_bytes(memory)


def train_step_footprint(cfg) -> tuple[int, int]:
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state = run.state
        t = cfg.train
        batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), np.int32, sharding=batch_sharding(mesh))
                 for k in ("inputs", "targets")}  # fmt: skip
        return footprint(compile_train_step(run).lower(state, batch).compile())


def serve_row(workdir, overrides: dict, batches, prompts) -> tuple:
    serving, _ = serving_setup(workdir, {**SERVE, **overrides})
    _, params, _ = load_params(workdir, dtype=serving.settings.dtype, quantize=serving.model.quantize)
    ppl = perplexity(params, serving.model, batches, serving.settings.kv_dtype)
    engine = load_engine(workdir, {**SERVE, **overrides})
    widest = engine.device.decode_steps[max(engine.device.decode_steps)]  # the most rows over the widest table
    return ppl, *footprint(widest), decode_rate(engine, prompts)


def decode_rate(engine, prompts) -> float:
    return engine_rates(engine, prompts, 64, repeats=3)["decode_8"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--steps", type=int, help="training steps per precision (default: the config's)")
    parser.add_argument("--workdir", default="runs/precision")
    args = parser.parse_args()
    base = load_config(args.config)
    base = base.updated(train=dict(steps=args.steps or base.train.steps))
    data = prepare_data(base.data, base.model)
    t = base.train
    val = eval_batches(data.tokens_dir, t.seq_len, t.batch_size, base.data.eval_batches, data.tokenizer.eos_id)
    prompts = np.stack([b["inputs"][0, :32] for b in val] * 2)[:8]
    runs = {}
    for name, overrides in TRAINING.items():
        runs[name] = base.overridden(overrides), pathlib.Path(args.workdir) / name
        train(*runs[name], progress=False)
    rows = {}  # measured after all training, one row after another
    for name, (cfg, workdir) in runs.items():
        ppl = perplexity(load_params(workdir)[1], cfg.model, val)
        rate = decode_rate(load_engine(workdir, SERVE), prompts)
        rows[f"train {name}"] = (ppl, *train_step_footprint(cfg), rate)
    for name, overrides in SERVING.items():
        rows[f"serve {name}"] = serve_row(pathlib.Path(args.workdir) / "bf16", overrides, val, prompts)
    print(f"\n{args.config}, {base.train.steps} steps, {jax.device_count()} {jax.default_backend()} device(s)")
    print(f"| {'precision':<22} | val perplexity | state / device | peak / device | decode tokens/s (8 slots) |")
    print(f"|{'-' * 24}|---------------:|---------------:|--------------:|--------------------------:|")
    for name, (ppl, state, peak, rate) in rows.items():
        print(f"| {name:<22} | {ppl:14.3f} | {state / 2**20:10.2f} MiB | {peak / 2**20:9.2f} MiB | {rate:25.1f} |")
    big = load_config("configs/120b.py").model
    widths = " | ".join(f"{width} {n / 1e9:.1f} GB" for width, n in plan.weight_bytes(big).items())
    print(f"\n120B weights ({plan.param_counts(big)['total'] / 1e9:.1f}B params): {widths}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
