"""The training loop: validate, prepare data, build or restore the state, step, evaluate, log,
checkpoint, and stop cleanly on preemption."""

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
from jaxllm.train.checkpoint import Checkpointer
from jaxllm.train.faults import Preemption, heartbeat, kill_self
from jaxllm.train.metrics import MetricsWriter, memory_in_use, peak_flops
from jaxllm.train.step import batch_sharding, compile_eval_step, compile_train_step, init_state


def _data_shard(sharding, batch_size: int) -> tuple[int, int, slice]:
    """(shard index, shard count, rows) of the global batch that this process's devices hold.
    Processes whose devices hold the same rows (across `stage` or `tensor`) read the same data."""
    blocks = {(s[0].start or 0, batch_size if s[0].stop is None else s[0].stop)
              for s in sharding.addressable_devices_indices_map((batch_size, 1)).values()}  # fmt: skip
    start, stop = min(b[0] for b in blocks), max(b[1] for b in blocks)
    if sum(b - a for a, b in blocks) != stop - start:
        raise ValueError(f"this process's batch rows {sorted(blocks)} are not contiguous; reorder the mesh devices")
    return start // (stop - start), batch_size // (stop - start), slice(start, stop)


def _global_batch(batch: dict[str, np.ndarray], sharding, batch_size: int) -> dict[str, jax.Array]:
    """Each process passes only its own rows; JAX assembles the global array."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:])) for k, v in batch.items()
    }


def train(cfg: ml_collections.ConfigDict, workdir: str | pathlib.Path, *, progress: bool = True) -> dict:
    """Trains `cfg` in `workdir`, resuming from its latest valid checkpoint; returns the last
    logged metrics. Writes `workdir/metrics.jsonl`, TensorBoard events and checkpoints."""
    validate(cfg, jax.device_count())
    mesh = make_mesh(cfg.parallel)
    schedule = schedule_of(cfg)
    t, debug = cfg.train, cfg.debug
    if progress:
        print(cfg.to_json_best_effort(indent=2))
    print(describe(mesh))
    print(plan.summary(cfg), flush=True)
    if cfg.model.remat == "offload" and jax.devices()[0].platform == "cpu":
        print("remat 'offload': on CPU host and device memory are one, so offloading saves nothing here")

    data = prepare_data(cfg)
    eos = data.tokenizer.eos_id
    shard, shards, rows = _data_shard(batch_sharding(mesh), t.batch_size)
    batches = train_batches(data.tokens_dir, t.seq_len, rows.stop - rows.start, t.seed, eos, shard, shards)
    val = [
        {k: v[rows] for k, v in b.items()}
        for b in eval_batches(data.tokens_dir, t.seq_len, t.batch_size, cfg.data.eval_batches, eos)
    ]

    peak, peak_source = peak_flops(jax.devices())
    flops_per_step = plan.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
    print(f"peak {peak / 1e12:.3f} TFLOP/s ({peak_source}); model {flops_per_step:.3e} FLOPs/step")

    with jax.set_mesh(mesh):
        checkpoints = Checkpointer(workdir, cfg, mesh)
        restored = checkpoints.restore_latest()
        skipped = 0  # non-finite steps so far, carried across restarts with the data position
        if restored is None:
            state, start = init_state(cfg, mesh), 0
        else:
            state, start = restored.state, restored.step
            batches.set_state(restored.data_state["loader"])
            skipped = restored.data_state["skipped_total"]
        writer = MetricsWriter(workdir, start_step=start)
        step_fn, eval_fn = compile_train_step(cfg, mesh), compile_eval_step(cfg, mesh)
        sharding = batch_sharding(mesh)
        val = [_global_batch(b, sharding, t.batch_size) for b in val]

        def evaluate(params) -> dict[str, float]:
            sums = [eval_fn(params, b) for b in val]
            loss = float(sum(s for s, _ in sums) / sum(n for _, n in sums))
            return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0))}

        preemption = Preemption()
        bar = tqdm(
            range(start + 1, t.steps + 1),
            initial=start,
            total=t.steps,
            desc="train",
            disable=not progress or jax.process_index() != 0,
            file=sys.stdout,
            dynamic_ncols=True,
            mininterval=1.0,
        )

        def position() -> dict:
            """What a checkpoint keeps besides the arrays: where the data is, and the skip count."""
            return {"loader": batches.get_state(), "skipped_total": skipped}

        last, latest_val, bad_steps = {}, {}, 0
        clock, clock_step, saved_step = time.perf_counter(), start, start
        try:
            for step in bar:
                state, metrics = step_fn(state, _global_batch(next(batches), sharding, t.batch_size))
                heartbeat(step)
                if int(metrics["skipped"]):
                    bad_steps, skipped = bad_steps + 1, skipped + 1
                    print(
                        f"step {step}: non-finite loss or gradients, update skipped ({bad_steps} in a row)", flush=True
                    )
                    if bad_steps >= cfg.checkpoint.max_bad_steps and (good := checkpoints.restore_latest()) is not None:
                        print(f"step {step}: back to the params of step {good.step}; the batches since are skipped")
                        state = {**good.state, "step": state["step"]}
                        bad_steps = 0
                else:
                    bad_steps = 0
                if checkpoints.due(step) or step == t.steps:
                    checkpoints.save(step, state, position())
                    saved_step = step
                    if debug.kill_during_save and step == debug.kill_at_step:
                        kill_self()
                if step == debug.kill_at_step:
                    checkpoints.wait()  # "between checkpoints": the earlier saves have landed
                    kill_self()
                stopping = preemption.reached(step)

                evaluating = step % cfg.data.eval_every == 0 or step == t.steps
                if evaluating or step % t.log_every == 0 or stopping:
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()} | {"skipped_total": skipped}
                    now = time.perf_counter()
                    if clock_step > start:  # the first step after start-up also paid for compilation
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
                        tok_s=f"{metrics.get('tokens_per_s', float('nan')):.0f}",
                        mfu=f"{metrics.get('mfu', 0):.1%}",
                    )
                if step == start + 1 or evaluating or step % t.log_every == 0:
                    clock, clock_step = time.perf_counter(), step  # compilation and evaluation are not training time
                if stopping:
                    if saved_step != step:
                        checkpoints.save(step, state, position())
                    print(f"preempted: checkpoint saved at step {step}; run the same command to resume")
                    return last
        finally:  # on success, preemption or error alike: flush metrics, finish pending saves
            bar.close()
            preemption.close()
            writer.close()
            checkpoints.close()

        prompt = data.tokenizer.encode(t.sample_prompt)
        length = min(len(prompt) + t.sample_tokens, cfg.model.max_seq_len)
        params = state["params"]
        if schedule is not None:  # generation runs the plain stack over the canonical group order
            params = {**params, "groups": canonical_view(params["groups"])}
        sample = generate(
            params, cfg.model, prompt, length, temperature=t.sample_temperature, top_k=t.sample_top_k, seed=t.seed
        )
    if jax.process_index() == 0:
        print("sample:", json.dumps(data.tokenizer.decode(sample)))
    return last
