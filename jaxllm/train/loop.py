"""The training loop: validate, prepare data, build mesh and state, step, evaluate, log, sample."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from jaxllm import plan
from jaxllm.config import validate
from jaxllm.data.dataset import prepare_data
from jaxllm.data.loader import eval_batches, train_batches
from jaxllm.model.generate import generate
from jaxllm.parallel.mesh import describe, make_mesh
from jaxllm.parallel.pipeline import canonical_view, schedule_of
from jaxllm.train.metrics import MetricsWriter, memory_in_use, peak_flops
from jaxllm.train.step import batch_sharding, compile_eval_step, compile_train_step, init_state


def _global_batch(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Each process passes only its own rows; JAX assembles the global array."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def _own_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rows = len(batch["inputs"]) // jax.process_count()
    return {k: v[jax.process_index() * rows : (jax.process_index() + 1) * rows] for k, v in batch.items()}


def train(cfg: ml_collections.ConfigDict, workdir: str | pathlib.Path, *, progress: bool = True) -> dict:
    """Trains `cfg` and returns the last logged metrics. Writes `workdir/metrics.jsonl`."""
    validate(cfg, jax.device_count())
    mesh = make_mesh(cfg.parallel)
    schedule = schedule_of(cfg)
    t = cfg.train
    if progress:
        print(cfg.to_json_best_effort(indent=2))
    print(describe(mesh))
    print(plan.summary(cfg), flush=True)

    data = prepare_data(cfg)
    eos = data.tokenizer.eos_id
    batches = train_batches(
        data.tokens_dir,
        t.seq_len,
        t.batch_size // jax.process_count(),
        t.seed,
        eos,
        jax.process_index(),
        jax.process_count(),
    )
    val = [_own_rows(b) for b in eval_batches(data.tokens_dir, t.seq_len, t.batch_size, cfg.data.eval_batches, eos)]

    peak, peak_source = peak_flops(jax.devices())
    flops_per_step = plan.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
    print(f"peak {peak / 1e12:.3f} TFLOP/s ({peak_source}); model {flops_per_step:.3e} FLOPs/step")

    writer = MetricsWriter(workdir)
    with jax.set_mesh(mesh):
        state = init_state(cfg, mesh)
        step_fn, eval_fn = compile_train_step(cfg, mesh), compile_eval_step(cfg, mesh)
        sharding = batch_sharding(mesh)
        val = [_global_batch(b, sharding) for b in val]

        def evaluate(params) -> dict[str, float]:
            sums = [eval_fn(params, b) for b in val]
            loss = float(sum(s for s, _ in sums) / sum(n for _, n in sums))
            return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0))}

        bar = tqdm(range(1, t.steps + 1), desc="train", disable=not progress, file=sys.stdout, dynamic_ncols=True)
        last, latest_val, clock, clock_step = {}, {}, None, 0
        for step in bar:
            state, metrics = step_fn(state, _global_batch(next(batches), sharding))
            evaluating = step % cfg.data.eval_every == 0 or step == t.steps
            if not evaluating and step % t.log_every and step != 1:
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
                if evaluating:
                    latest_val = evaluate(state["params"])
                    metrics |= latest_val
                writer.write(step, metrics)
                last = {"step": step, **metrics}
                bar.set_postfix(
                    loss=f"{metrics['loss']:.3f}",
                    val=f"{latest_val.get('val_loss', float('nan')):.3f}",
                    tok_s=f"{metrics['tokens_per_s']:.0f}",
                    mfu=f"{metrics['mfu']:.1%}",
                )
            clock, clock_step = time.perf_counter(), step  # evaluation time is not training time
        bar.close()
        writer.close()

        prompt = data.tokenizer.encode(t.sample_prompt)
        length = min(len(prompt) + t.sample_tokens, cfg.model.max_seq_len)
        params = state["params"]
        if schedule is not None:  # generation runs the plain stack over the canonical group order
            params = {**params, "groups": canonical_view(params["groups"])}
        sample = generate(
            params, cfg.model, prompt, length, temperature=t.sample_temperature, top_k=t.sample_top_k, seed=t.seed
        )
    print("sample:", json.dumps(data.tokenizer.decode(sample)))
    return last
