"""8 fake CPU devices for every test; the XLA flag must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxllm.config import base_config  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jaxllm-tests-xla"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def small_config(**model):
    """A model small enough to compile in seconds, big enough to split 8 ways on every axis."""
    cfg = base_config()
    cfg.model.update(
        num_layers=4,
        hidden=64,
        num_heads=8,
        num_kv_heads=4,
        mlp=128,
        vocab_size=257,
        max_seq_len=64,
        qkv_share_every=2,
        dtype="float32",
        init_std=0.05,
    )
    cfg.model.update(model)
    cfg.parallel.update(data=1, fsdp=1, stage=1, tensor=1)
    cfg.train.update(steps=10, batch_size=16, seq_len=16, lr=1e-2, warmup_steps=1, log_every=1)
    return cfg


@pytest.fixture
def cfg():
    return small_config()


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
