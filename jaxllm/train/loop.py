"""The training loop: validate, build mesh and state, step, log, sample."""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from jaxllm import plan
from jaxllm.config import validate
from jaxllm.data.stdlib_text import ByteTokenizer, random_windows, stdlib_tokens
from jaxllm.model.generate import greedy_generate
from jaxllm.parallel.mesh import describe, make_mesh
from jaxllm.parallel.pipeline import canonical_view, schedule_of
from jaxllm.train.metrics import MetricsWriter, memory_in_use, peak_flops
from jaxllm.train.step import batch_sharding, compile_train_step, init_state


def _global_batch(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Each process passes only its own rows; JAX assembles the global array."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def train(cfg: ml_collections.ConfigDict, workdir: str | pathlib.Path, *, progress: bool = True) -> dict:
    """Trains `cfg` and returns the last logged metrics. Writes `workdir/metrics.jsonl`."""
    validate(cfg, jax.device_count())
    mesh = make_mesh(cfg.parallel)
    t = cfg.train
    if progress:
        print(cfg.to_json_best_effort(indent=2))
    print(describe(mesh))
    print(plan.summary(cfg), flush=True)
    schedule = schedule_of(cfg)

    tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} tokens; "
            f"set model.vocab_size >= {tokenizer.vocab_size}"
        )
    tokens = stdlib_tokens(cfg.data.max_bytes)
    print(f"data: {tokens.size:,} byte tokens of Python standard-library source")
    rows_per_process = t.batch_size // jax.process_count()
    batches = random_windows(tokens, rows_per_process, t.seq_len, seed=t.seed + jax.process_index())

    peak, peak_source = peak_flops(jax.devices())
    flops_per_step = plan.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
    print(f"peak {peak / 1e12:.3f} TFLOP/s ({peak_source}); model {flops_per_step:.3e} FLOPs/step")

    writer = MetricsWriter(workdir)
    with jax.set_mesh(mesh):
        state = init_state(cfg, mesh)
        step_fn = compile_train_step(cfg, mesh)
        sharding = batch_sharding(mesh)
        bar = tqdm(range(1, t.steps + 1), desc="train", disable=not progress, file=sys.stdout, dynamic_ncols=True)
        last, clock, clock_step = {}, None, 0
        for step in bar:
            state, metrics = step_fn(state, _global_batch(next(batches), sharding))
            if step % t.log_every and step != t.steps and step != 1:
                continue
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            if clock is not None:  # the first step (compilation) starts the clock
                step_time = (now - clock) / (step - clock_step)
                metrics |= {
                    "step_time_s": step_time,
                    "tokens_per_s": t.batch_size * t.seq_len / step_time,
                    "mfu": flops_per_step / step_time / peak,
                }
                if schedule is not None:
                    metrics["bubble"] = schedule.bubble
                if (mem := memory_in_use()) is not None:
                    metrics["memory_bytes"] = mem
                writer.write(step, metrics)
                last = {"step": step, **metrics}
                bar.set_postfix(
                    loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}", mfu=f"{metrics['mfu']:.1%}"
                )
            clock, clock_step = now, step
        bar.close()
        writer.close()

        prompt = tokenizer.encode(t.sample_prompt)
        length = min(len(prompt) + t.sample_tokens, cfg.model.max_seq_len)
        params = state["params"]
        if schedule is not None:  # generation runs the plain stack over the canonical group order
            params = {**params, "groups": canonical_view(params["groups"])}
        sample = greedy_generate(params, cfg.model, prompt, length)
    print("sample:", json.dumps(tokenizer.decode(sample)))
    return last
