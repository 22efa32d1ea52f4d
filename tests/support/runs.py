"""What tests share: the small config, the train command and its runs, and readers of what a run
wrote."""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax

from jaxllm.config import RunConfig
from support.xla_flags import xla_flags

ROOT = pathlib.Path(__file__).parents[2]
# The suite's compilation cache, in-process and in the training runs it starts: a run that compiles
# what an earlier one did (a resume, the same layout again) reads it back.
XLA_CACHE = pathlib.Path.home() / ".cache" / "jaxllm-tests-xla"


def small_config(**model) -> RunConfig:
    """A model small enough to compile in seconds, big enough to split 8 ways on every axis. No
    warmup: optax's linear warmup starts at lr 0, so with any the first update would change nothing."""
    model = dict(num_layers=4, hidden=64, num_heads=8, num_kv_heads=4, mlp=128, vocab_size=257, max_seq_len=64,
                 qkv_share_every=2, dtype="float32", init_std=0.05) | model  # fmt: skip
    return RunConfig().updated(
        model=model,
        parallel=dict(data=1, fsdp=1, stage=1, tensor=1),
        data=dict(bpe_vocab_size=256),
        train=dict(steps=10, batch_size=16, seq_len=16, lr=1e-2, warmup_steps=0, log_every=1),
    )


def stdlib_glob(package: str) -> str:
    """A small real corpus: one standard-library package's sources."""
    import sysconfig

    return f"{sysconfig.get_paths()['stdlib']}/{package}/*.py"


def cli_data_flags(data_dir) -> list[str]:
    """Train-CLI overrides that keep data preparation fast: a small corpus and a 512-token BPE."""
    return [
        f"--config.data.dir={data_dir}",
        f"--config.data.inputs={stdlib_glob('email')},{stdlib_glob('json')}",
        "--config.data.bpe_vocab_size=512",
        "--config.model.vocab_size=512",
        "--config.data.val_fraction=0.1",
        "--config.data.eval_batches=2",
    ]


def train_command(workdir, *overrides, data_dir=None) -> list[str]:
    """`python -m jaxllm.train` on the tiny config shrunk to seconds a run; later flags win."""
    workdir = pathlib.Path(workdir)
    return [
        sys.executable, "-m", "jaxllm.train", "--config", "configs/tiny.py", "--workdir", str(workdir),
        "--config.model.num_layers=4", "--config.model.hidden=64", "--config.model.mlp=192",
        "--config.train.steps=12", "--config.train.seq_len=32", "--config.train.log_every=2",
        "--config.train.sample_tokens=4", "--config.data.eval_every=6", f"--config.train.compile_cache={XLA_CACHE}",
        *cli_data_flags(data_dir or workdir.parent / "data"), *overrides,
    ]  # fmt: skip


def device_env(devices: int = 8, quick: bool = True) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": xla_flags(devices, quick)}


def run(command: list[str], devices: int = 8, check: bool = True, quick: bool = True) -> subprocess.CompletedProcess:
    env = device_env(devices, quick)
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def start_until_first_step(command: list[str], workdir, devices: int = 8, **popen) -> subprocess.Popen:
    """Starts a training command and returns once it has logged its first step."""
    proc = subprocess.Popen(command, cwd=ROOT, env=device_env(devices), text=True, **popen)
    path = pathlib.Path(workdir) / "metrics.jsonl"
    deadline = time.time() + 300
    while not path.exists() or not path.read_text():
        assert time.time() < deadline and proc.poll() is None, "training never logged a step"
        time.sleep(0.2)
    return proc


def checkpoint_params(workdir, step: int) -> dict:
    """The params of a run's checkpoint, read with Orbax as saved (numpy arrays)."""
    import numpy as np
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(pathlib.Path(workdir) / "checkpoints", item_names=("state",))
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    return jax.tree.map(np.asarray, state["params"])


def metrics(workdir) -> list[dict]:
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
