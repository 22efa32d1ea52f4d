"""Data throughput against the tiny model's appetite, measured side by side in one run.

    python scripts/bench_data.py

Prints prepare throughput (MB of text per second, tokenizing in worker processes), loader
throughput (tokens per second out of the grain pipeline: packing, shuffling, batching) and the
tiny model's training consumption (tokens per second on this machine's CPU).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import throughput  # noqa: E402

from jaxllm.config import load_config  # noqa: E402
from jaxllm.data.corpus import read_documents, resolve_inputs  # noqa: E402
from jaxllm.data.loader import train_batches  # noqa: E402
from jaxllm.data.prepare import prepare  # noqa: E402
from jaxllm.data.tokenizer import get_tokenizer, train_bpe  # noqa: E402
from jaxllm.parallel.mesh import make_mesh  # noqa: E402


def main() -> None:
    cfg = load_config("configs/tiny.py")
    files = resolve_inputs(["stdlib"])
    megabytes = sum(f.stat().st_size for f in files) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        bpe = str(train_bpe((t for f in files for _, t in read_documents(f)), cfg.data.bpe_vocab_size, tmp))
        rates = {}
        for name, out in ((bpe, "bpe"), ("gpt2", "gpt2")):
            start = time.perf_counter()
            prepare(["stdlib"], name, Path(tmp) / out, progress=False)
            rates[f"{out}, {get_tokenizer(name).vocab_size} tokens"] = megabytes / (time.perf_counter() - start)

        t = cfg.train
        batches = train_batches(Path(tmp) / "bpe", t.seq_len, t.batch_size, 0, get_tokenizer(bpe).eos_id)
        next(batches)
        start, tokens = time.perf_counter(), 0
        while time.perf_counter() - start < 3:
            tokens += next(batches)["inputs"].size
        loader = tokens / (time.perf_counter() - start)

    cfg = cfg.updated(parallel=dict(data=1))
    seconds, _ = throughput(cfg, make_mesh(cfg.parallel, jax.devices()[:1]), steps=10)
    consumption = t.batch_size * t.seq_len / seconds
    print(f"stdlib corpus: {megabytes:.1f} MB of text, {len(files)} files")
    for name, rate in rates.items():
        print(f"prepare ({name:>18}): {rate:8.2f} MB/s")
    print(f"loader:                  {loader:12,.0f} tokens/s  (batches of {t.batch_size} × {t.seq_len})")
    print(f"tiny model training:     {consumption:12,.0f} tokens/s")
    print(f"loader / training:       {loader / consumption:12,.0f}x")


if __name__ == "__main__":
    main()
