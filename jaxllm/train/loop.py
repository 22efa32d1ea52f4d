"""The training loop: validate, prepare data, build or restore the state, step, evaluate, log,
checkpoint, and stop cleanly on preemption. `train` is the loop; `Loop` holds what it needs and
does each named step around it."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from jaxllm import heartbeat, logs, plan
from jaxllm.checkpoint import Checkpointer
from jaxllm.checkpoint.layout import to_canonical
from jaxllm.config import RunConfig, step_range, validate
from jaxllm.data.dataset import prepare_data
from jaxllm.data.loader import eval_batches, train_batches
from jaxllm.data.tokenizer import prompt_ids, save_tokenizer
from jaxllm.model.decoder import Model
from jaxllm.model.generate import generate
from jaxllm.model.sampling import Sampling
from jaxllm.parallel import timetable
from jaxllm.parallel.distributed import check_shared
from jaxllm.parallel.mesh import describe, make_mesh
from jaxllm.parallel.rules import RULES, activation_rules
from jaxllm.profile import OncePerRun, StepProfiler
from jaxllm.profile.capture import stages_of
from jaxllm.train.faults import NonFiniteSteps, Preemption
from jaxllm.train.goodput import Ledger, account, format_account
from jaxllm.train.metrics import MetricsWriter, memory_fractions, memory_in_use, peak_flops
from jaxllm.train.run import Run, State, build_run
from jaxllm.train.step import compile_eval_step, compile_train_step, init_state

log = logs.get(__name__)


def _data_shard(sharding, batch_size: int) -> tuple[int, int, slice]:
    """(shard index, shard count, rows) of the global batch that this process's devices hold.
    Processes whose devices hold the same rows (across `stage` or `tensor`) read the same data."""
    blocks = {(s[0].start or 0, batch_size if s[0].stop is None else s[0].stop)
              for s in sharding.addressable_devices_indices_map((batch_size, 1)).values()}  # fmt: skip
    start, stop = min(b[0] for b in blocks), max(b[1] for b in blocks)
    if sum(b - a for a, b in blocks) != stop - start:
        raise ValueError(f"this process's batch rows {sorted(blocks)} are not contiguous; reorder the mesh devices")
    return start // (stop - start), batch_size // (stop - start), slice(start, stop)


def train(
    cfg: RunConfig, workdir: str | pathlib.Path, *, progress: bool = True, hooks: Hooks | None = None,
    ledger: Ledger | None = None,
) -> dict:  # fmt: skip
    """Trains `cfg` in `workdir`, resuming from its latest valid checkpoint; returns the last
    logged metrics. Writes `workdir/metrics.jsonl`, TensorBoard events, checkpoints and, on process
    0, the goodput ledger (`ledger`, if the caller opened it earlier)."""
    ledger = ledger or Ledger(workdir)
    ledger.active = jax.process_index() == 0
    logs.set_process(jax.process_index())
    validate(cfg, jax.device_count(), jax.default_backend())
    run = build_run(cfg, make_mesh(cfg.parallel))
    _announce(run, progress)
    check_shared(workdir, "--workdir")
    ledger.mark("startup")
    data = load_data(cfg, workdir)
    ledger.mark("data")
    peak = peak_flops(jax.devices())  # outside the mesh, where a matmul runs on one device
    with jax.set_mesh(run.mesh):
        loop = Loop(run, workdir, data, peak, progress, hooks or Hooks(), ledger)
        try:
            for step in loop.bar:
                loop.profiler.before(step)
                loop.state, metrics = loop.step_fn(loop.state, loop.next_batch(step))
                profiled = loop.profiler.after(step, (loop.state, metrics))
                loop.handle_non_finite(loop.non_finite.push(step, metrics["skipped"]))
                loop.account(step - 1)  # reading its flag waited for the step before
                # A beat for a finished step, not a dispatched one: a process that compiled its first
                # step sooner than the others waits for them in that step, under the start-up timeout.
                if step - 1 > loop.start:
                    heartbeat.beat(step - 1, jax.process_index())
                loop.checkpoint(step)
                loop.hooks.stepped(step, loop)
                stopping = loop.preemption.reached(step)
                loop.log(step, metrics, force=stopping or profiled is not None)
                if stopping:
                    loop.save_and_stop(step)
                    return loop.last
            loop.handle_non_finite(loop.non_finite.flush())
            loop.account(loop.run.cfg.train.steps, settle=True)
            heartbeat.beat(cfg.train.steps, jax.process_index(), slow="the last save and the sample")
        finally:  # on success, preemption or error alike: flush metrics, finish pending saves
            loop.close()
        sample = loop.sample()
    ledger.mark("evaluate")
    heartbeat.stopped(heartbeat.FINISHED, cfg.train.steps, jax.process_index())
    if jax.process_index() == 0:  # the run's results, once: the same sample everywhere, the ledger's one writer
        if sample is not None:
            log.info(f"sample: {json.dumps(sample)}")
        goodput = account(workdir)
        (pathlib.Path(workdir) / "goodput.json").write_text(json.dumps(goodput, indent=2))
        log.info(format_account(goodput))
    return loop.last


def load_data(cfg: RunConfig, workdir: str | pathlib.Path):
    """The run's tokenizer and prepared data (process 0 prepares what is missing while the others
    wait), with the tokenizer copied into the workdir, where serving and export read it."""
    check_shared(cfg.data.dir, "data.dir")  # before the others read what process 0 prepares there
    data = prepare_data(cfg.data, cfg.model)
    if jax.process_index() == 0:
        save_tokenizer(data.tokenizer, pathlib.Path(workdir) / "tokenizer")
    return data


def _announce(run: Run, progress: bool) -> None:
    if progress:
        log.info(json.dumps(run.cfg.to_dict(), indent=2))
    log.info(describe(run.mesh))
    log.info(plan.summary(run.cfg))
    for note in offload_notes(run.cfg, jax.devices()[0].platform):
        log.info(note)


def offload_notes(cfg: RunConfig, platform: str) -> list[str]:
    """What each host offload in `cfg` does on `platform`, said at start-up."""
    offloaded = {
        "model.remat='offload': the named activations go to": cfg.model.remat == "offload",
        "parallel.offload_optimizer: the optimizer state lives in": cfg.parallel.offload_optimizer,
    }
    where = (
        "which on CPU is the device's own memory, so this saves nothing here"
        if platform == "cpu"
        else ("and each step moves it in and out over the host link")
    )
    return [f"{what} pinned_host memory, {where}" for what, on in offloaded.items() if on]


def roll_back(checkpoints: Checkpointer, state: State, before: int) -> tuple[State, int] | None:
    """The params and optimizer state of the newest checkpoint saved before step `before` (the
    step counter goes on), or None if there is none. The current state is freed first, so two
    full states never share device memory."""
    if not any(s < before for s in checkpoints.manager.all_steps()):
        return None
    for array in jax.tree.leaves({k: v for k, v in state.items() if k != "step"}):
        array.delete()
    good = checkpoints.restore_latest(before=before)
    return {**good.state, "step": state["step"]}, good.step


class Hooks:
    """Where a caller reaches into a run between its steps (tests inject faults here: a poisoned
    batch, a kill after a step or during a save); by default nothing happens."""

    def batch(self, step: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch (this process's rows, on the host) that step `step` trains on."""
        return batch

    def saved(self, step: int, loop: Loop) -> None:
        """The asynchronous save of step `step` has started."""

    def stepped(self, step: int, loop: Loop) -> None:
        """Step `step` is done, and saved if one was due."""


class Loop:
    """A run's moving parts: data, state, compiled steps, checkpoints, metrics, preemption."""

    def __init__(self, run: Run, workdir: str | pathlib.Path, data, peak: tuple[float, str], progress: bool,
                 hooks: Hooks, ledger: Ledger):  # fmt: skip
        cfg, t = run.cfg, run.cfg.train
        self.run, self.data, self.hooks, self.ledger = run, data, hooks, ledger
        eos = data.tokenizer.eos_id
        shard, shards, self.rows = _data_shard(run.batch_sharding, t.batch_size)
        self.batches = train_batches(
            data.tokens_dir, t.seq_len, self.rows.stop - self.rows.start, t.seed, eos, shard, shards,
            overlong=cfg.data.overlong,
        )  # fmt: skip
        val = eval_batches(data.tokens_dir, t.seq_len, t.batch_size, cfg.data.eval_batches, eos, cfg.data.overlong)
        self.val = [self._global({k: v[self.rows] for k, v in b.items()}) for b in val]
        self.peak, peak_source = peak
        self.flops_per_step = plan.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
        log.info(f"peak {self.peak / 1e12:.3f} TFLOP/s ({peak_source}); model {self.flops_per_step:.3e} FLOPs/step")

        self.checkpoints = run.checkpointer(workdir)
        ledger.mark("startup")
        restored = self.checkpoints.restore_latest()
        ledger.mark("restore", step=0 if restored is None else restored.step)
        skipped = 0  # non-finite steps so far, carried across restarts with the data position
        if restored is None:
            self.state, self.start = init_state(run), 0
            if cfg.init.hf:
                log.info(f"init: params from {cfg.init.hf}, a fresh optimizer")
        else:
            self.state, self.start = restored.state, restored.step
            self.batches.set_state(restored.data_state["loader"])
            skipped = restored.data_state["skipped_total"]
        self.non_finite = NonFiniteSteps(skipped, cfg.checkpoint.max_bad_steps)
        self.writer = MetricsWriter(workdir, start_step=self.start)
        self.step_fn, self.eval_fn = compile_train_step(run), compile_eval_step(run)
        self.preemption = Preemption()
        self.bar = tqdm(
            range(self.start + 1, t.steps + 1),
            initial=self.start,
            total=t.steps,
            desc="train",
            disable=not progress or jax.process_index() != 0,
            file=sys.stdout,
            dynamic_ncols=True,
            mininterval=1.0,
        )
        self.last, self.latest_val = {}, {}
        self.warnings = OncePerRun()  # each out-of-band ratio warned about once a run
        profiled = step_range(t.profile_steps, "train.profile_steps") or (0, -1)
        if 0 < profiled[0] <= self.start:  # the trace would start after step A − 1
            log.warning(f"train.profile_steps={t.profile_steps} starts at or before step {self.start}, where this "
                        "run resumes, so nothing is traced; profile later steps, or in a new --workdir")  # fmt: skip
        self.profiler = StepProfiler(
            profiled,
            pathlib.Path(workdir) / "profile",
            module="jit_train_step",
            schedule=run.schedule,
            stage_of=stages_of(run.mesh),
            loop_steps=timetable.steps_of(run.schedule),
            on_summary=lambda s: log.info(s.format()),
        )
        self.clock, self.clock_step, self.saved_step = time.perf_counter(), self.start, self.start
        self.accounted = self.start  # the last step whose time the ledger holds

    def _global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Each process passes only its own rows; JAX assembles the global array."""
        size = self.run.cfg.train.batch_size
        sharding = self.run.batch_sharding
        return {k: jax.make_array_from_process_local_data(sharding, v, (size, *v.shape[1:])) for k, v in batch.items()}

    def next_batch(self, step: int) -> dict[str, jax.Array]:
        return self._global(self.hooks.batch(step, next(self.batches)))

    def position(self) -> dict:
        """What a checkpoint keeps besides the arrays: where the data is, and the skip count."""
        return {"loader": self.batches.get_state(), "skipped_total": self.non_finite.total_so_far()}

    def handle_non_finite(self, streak_start: int | None) -> None:
        """After `checkpoint.max_bad_steps` skipped updates in a row (counted by `non_finite`), rolls
        back to the newest checkpoint saved before the streak began; the batches since stay behind."""
        if streak_start is None:
            return
        self.checkpoints.wait()
        if (back := roll_back(self.checkpoints, self.state, before=streak_start)) is not None:
            self.state, good_step = back
            self.ledger.mark("restore", step=good_step)
            last_bad = streak_start + self.non_finite.in_a_row - 1
            log.info(f"step {last_bad}: back to the params of step {good_step}; the batches since are skipped")
            self.non_finite.restart()

    def account(self, step: int, settle: bool = False) -> None:
        """The ledger's span since its last mark was step `step` (the run's first step: its
        compilation too), once `step` is done; `settle` waits for it first."""
        if step <= self.accounted:
            return
        if settle:
            jax.block_until_ready(self.state)
        if step == self.start + 1:
            self.ledger.mark("startup")
        else:
            self.ledger.mark("step", step=step)
        self.accounted = step

    def checkpoint(self, step: int) -> None:
        if self.checkpoints.due(step) or step == self.run.cfg.train.steps:
            self.save(step)
            self.hooks.saved(step, self)
        elif self.checkpoints.due_local(step):
            self.save(step, local=True)

    def save(self, step: int, local: bool = False) -> None:
        """Starts saving step `step` (to the fast tier, if `local`); the ledger counts the part that
        blocks training."""
        self.account(step, settle=True)
        (self.checkpoints.save_local if local else self.checkpoints.save)(step, self.state, self.position())
        self.ledger.mark("save")
        if not local:
            self.saved_step = step

    def evaluate(self) -> dict[str, float]:
        sums = [self.eval_fn(self.state["params"], b) for b in self.val]
        loss = float(sum(s for s, _ in sums) / sum(n for _, n in sums))
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0))}

    def log(self, step: int, metrics: dict, force: bool) -> None:
        """Every `train.log_every` steps (and at evaluations): metrics to JSONL, TensorBoard and the bar."""
        t = self.run.cfg.train
        evaluating = step % self.run.cfg.data.eval_every == 0 or step == t.steps
        if evaluating or step % t.log_every == 0 or force:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            metrics["skipped_total"] = self.non_finite.total_so_far()
            if self.clock_step > self.start:  # the first step after start-up also paid for compilation
                step_time = (time.perf_counter() - self.clock) / (step - self.clock_step)
                metrics |= {
                    "step_time_s": step_time,
                    "tokens_per_s": t.batch_size * t.seq_len / step_time,
                    "mfu": self.flops_per_step / step_time / self.peak,
                }
            if self.run.schedule is not None:
                metrics["bubble"] = timetable.bubble_of(self.run.schedule)
            if (mem := memory_in_use()) is not None:
                metrics["memory_bytes"] = mem
            metrics |= memory_fractions()
            if self.profiler.summary is not None and self.profiler.last == step:
                metrics |= self.profiler.summary.metrics()
            self.warn(metrics)
            if evaluating:
                self.account(step, settle=True)
                heartbeat.beat(step, jax.process_index(), slow="an evaluation")  # the first compiles
                self.latest_val = self.evaluate()
                heartbeat.beat(step, jax.process_index())
                self.ledger.mark("evaluate")
                metrics |= self.latest_val
            self.writer.write(step, metrics)
            self.last = {"step": step, **metrics}
            self.bar.set_postfix(self._postfix(metrics))
        if step == self.start + 1 or evaluating or step % t.log_every == 0:
            self.clock, self.clock_step = time.perf_counter(), step  # compilation and evaluation are not training time

    def warn(self, metrics: dict) -> None:
        """One warning a run for each health ratio outside its band (see jaxllm.profile.health)."""
        for warning in self.warnings.new(metrics):
            log.warning(warning)

    def _postfix(self, metrics: dict) -> dict[str, str]:
        """What the progress bar shows: only figures measured so far (no validation loss before
        the first evaluation, no speed for the step that paid for compilation)."""
        shown = {"loss": f"{metrics['loss']:.3f}"}
        if "val_loss" in self.latest_val:
            shown["val"] = f"{self.latest_val['val_loss']:.3f}"
        if "tokens_per_s" in metrics:
            shown |= {"tok_s": f"{metrics['tokens_per_s']:.0f}", "mfu": f"{metrics['mfu']:.1%}"}
        return shown

    def save_and_stop(self, step: int) -> None:
        if self.saved_step != step:
            self.save(step)
        self.checkpoints.wait()
        self.ledger.mark("save")
        heartbeat.stopped(heartbeat.PREEMPTED, step, jax.process_index())
        log.info(f"preempted: checkpoint saved at step {step}; run the same command to resume")

    def sample(self) -> str | None:
        """The end-of-training sample, from the plain stack over the canonical group order (None
        with `train.sample_tokens=0`)."""
        t, model = self.run.cfg.train, self.run.cfg.model
        if t.sample_tokens == 0:
            return None
        tokenizer = self.data.tokenizer
        prompt = prompt_ids(tokenizer, t.sample_prompt)
        length = min(len(prompt) + t.sample_tokens, model.max_seq_len)
        params = to_canonical(self.state["params"], self.run.schedule)
        sampling = Sampling.one(t.sample_temperature, t.sample_top_k, t.sample_top_p, seed=t.seed)
        with activation_rules({**RULES, "batch": None}):  # one sequence: not split over data-parallel devices
            tokens = generate(params, Model(model), prompt, length, sampling, tokenizer.vocab_size)
        return tokenizer.decode(tokens[len(tokenizer.prompt_prefix) :])

    def close(self) -> None:
        self.profiler.close()
        self.bar.close()
        self.preemption.close()
        self.writer.close()
        self.checkpoints.close()
        self.ledger.mark("save")
