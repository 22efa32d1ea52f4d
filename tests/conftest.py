"""8 fake CPU devices for every test; the XLA flags must be set before jax is imported. Without
excess precision, bf16 rounds where the program says: two layouts' bf16 results then differ by
their arithmetic, not by which ops the CPU compiler happened to fuse in fp32."""

import gc
import os

from support.xla_flags import xla_flags

# Added once: pytest-xdist's workers inherit the flags the controller set, and flags written twice
# would give the compilation cache's keys another spelling than a run without workers.
_flags = os.environ.get("XLA_FLAGS", "").split()
_wanted = (*xla_flags(8).split(), "--xla_allow_excess_precision=false")
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _wanted if f not in _flags])

import jax  # noqa: E402
import pytest  # noqa: E402
from support.runs import XLA_CACHE, small_config, stdlib_glob  # noqa: E402

# Every executable is kept, the smallest too: the suite compiles thousands of eager ops and small
# jits at ~0.1 s each, which read back from disk in a few milliseconds.
jax.config.update("jax_compilation_cache_dir", str(XLA_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_configure(config):
    # pytest-xdist hands out the files with the most tests first; the order below is kept instead
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The files marked `minutes(N)` first, longest first: with `--dist loadfile` a worker then ends
    on short files, not alone on a long one after the other has run out of work."""

    def minutes(item) -> float:
        marker = item.get_closest_marker("minutes")
        return marker.args[0] if marker else 0

    items.sort(key=minutes, reverse=True)


@pytest.fixture(scope="module", autouse=True)
def release_executables():
    """After each test file, the programs JAX's caches hold are let go. XLA:CPU maps each
    executable's code in many memory regions, and a worker that kept every file's would pass the
    kernel's limit on a process's mappings (vm.max_map_count, 65,530 by default): XLA's loader then
    crashes the process at its next compile or compilation-cache read (docs/testing.md)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def caplog(caplog):
    """pytest's caplog, which listens at the root logger, also listening at jaxllm's, which keeps
    its records from the root (see jaxllm/logs.py)."""
    import logging

    logger = logging.getLogger("jaxllm")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Two steps of a 2-stage pipeline (data 4) with a real BPE, checkpointed as a run does: a
    model for serving tests, trained from any layout."""
    import numpy as np

    from jaxllm.data.corpus import read_documents, resolve_inputs
    from jaxllm.data.tokenizer import get_tokenizer, save_tokenizer, train_bpe
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.train.run import batch_sharding, build_run
    from jaxllm.train.step import compile_train_step, init_state

    workdir = tmp_path_factory.mktemp("run")
    texts = (text for f in resolve_inputs([stdlib_glob("json")]) for _, text in read_documents(f))
    tokenizer = get_tokenizer(train_bpe(texts, 300, workdir / "bpe"))
    save_tokenizer(tokenizer, workdir / "tokenizer")
    cfg = small_config(vocab_size=300).updated(parallel=dict(stage=2, microbatches=2, data=4))
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state, step = init_state(run), compile_train_step(run)
        for i in range(2):
            w = np.random.default_rng(i).integers(0, 300, (cfg.train.batch_size, cfg.train.seq_len + 1), np.int32)
            state, _ = step(state, jax.device_put({"inputs": w[:, :-1], "targets": w[:, 1:]}, batch_sharding(mesh)))
        checkpoints = run.checkpointer(workdir)
        checkpoints.save(2, state, {})
        checkpoints.close()
    return workdir, cfg.model, tokenizer
