"""Text → token shards on disk, tokenized in worker processes.

    python -m jaxllm.data.prepare --input 'corpus/*.jsonl' --tokenizer gpt2 --output data/corpus

Layout of the output directory (raw little-endian arrays that `np.memmap` opens without copying):
- `{split}-{k:05d}.bin`: tokens of whole documents, each followed by the end-of-text id;
- `{split}.docs`: the key of every document in that split (file, or file:line for JSONL);
- `meta.json`: tokenizer identity and hash, dtype, shard token counts, document counts, and the
  inputs it was made from. Running it again on unchanged inputs does nothing.
Documents go to `val` by a hash of their key, so the split is stable and disjoint by document.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import shutil
import zlib

import numpy as np
from tqdm import tqdm

from jaxllm import cli
from jaxllm.data.corpus import CorpusError, read_documents, resolve_inputs
from jaxllm.data.tokenizer import get_tokenizer
from jaxllm.errors import exit_on_error

FORMAT = 1
SPLITS = ("train", "val")
SHARD_TOKENS = 1 << 28

_worker_tokenizer = None


def split_of(key: str, val_fraction: float) -> str:
    return "val" if zlib.crc32(key.encode()) % 100_000 < val_fraction * 100_000 else "train"


def _init_worker(tokenizer_spec: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = get_tokenizer(tokenizer_spec)


def _tokenize_file(path: pathlib.Path) -> list[tuple[str, list[int]]]:
    docs = list(read_documents(path))
    ids = _worker_tokenizer.encode_batch([text for _, text in docs])
    # Each document as its model's tokenizer starts a text (a Llama's bos), then eos.
    start, end = list(_worker_tokenizer.prompt_prefix), [_worker_tokenizer.eos_id]
    return [(key, start + doc + end) for (key, _), doc in zip(docs, ids, strict=True)]


class _ShardWriter:
    def __init__(self, directory: pathlib.Path, split: str, dtype: np.dtype):
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shards: list[dict] = []
        self.keys: list[str] = []
        self._file = None

    def add(self, key: str, ids: list[int]) -> None:
        if self._file is None or self.shards[-1]["tokens"] + len(ids) > SHARD_TOKENS:
            self._roll()
        np.asarray(ids, self.dtype).tofile(self._file)
        self.shards[-1]["tokens"] += len(ids)
        self.keys.append(key)

    def _roll(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.directory / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> dict:
        if self._file is not None:
            self._file.close()
        (self.directory / f"{self.split}.docs").write_text("".join(k + "\n" for k in self.keys))
        return {"shards": self.shards, "documents": len(self.keys), "tokens": sum(s["tokens"] for s in self.shards)}


def _source(files: list[pathlib.Path], tokenizer, val_fraction: float) -> dict:
    """What the output depends on: if this is unchanged, the output is already right."""
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return {
        "format": FORMAT,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "val_fraction": val_fraction,
        "inputs_fingerprint": zlib.crc32(json.dumps(stats).encode()),
        "files": len(files),
    }


def read_meta(directory: str | pathlib.Path) -> dict | None:
    path = pathlib.Path(directory) / "meta.json"
    return json.loads(path.read_text()) if path.exists() else None


def prepare(
    inputs: list[str],
    tokenizer_spec: str,
    output: str | pathlib.Path,
    val_fraction: float = 0.02,
    workers: int | None = None,
    progress: bool = True,
) -> dict:
    """Tokenizes `inputs` into `output` (atomically) and returns the metadata."""
    output = pathlib.Path(output)
    files = resolve_inputs(inputs)
    tokenizer = get_tokenizer(tokenizer_spec)
    source = _source(files, tokenizer, val_fraction)
    if (meta := read_meta(output)) is not None and meta["source"] == source:
        print(f"data: {output} is already prepared from these inputs")
        return meta
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writers = {split: _ShardWriter(tmp, split, dtype) for split in SPLITS}
    workers = workers or min(8, os.cpu_count() or 1)
    total_bytes = sum(f.stat().st_size for f in files)
    context = multiprocessing.get_context("spawn")  # never fork a process that may run JAX threads
    with (
        context.Pool(workers, _init_worker, (tokenizer_spec,)) as pool,
        tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not progress) as bar,
    ):
        for path, docs in zip(files, pool.imap(_tokenize_file, files, chunksize=4), strict=True):
            for key, ids in docs:
                writers[split_of(key, val_fraction)].add(key, ids)
            bar.update(path.stat().st_size)
    splits = {split: w.close() for split, w in writers.items()}
    if splits["train"]["documents"] == 0:
        shutil.rmtree(tmp)
        raise CorpusError(f"inputs {inputs} contain no text documents; point data.inputs at text files")
    if val_fraction > 0 and splits["val"]["documents"] == 0:
        shutil.rmtree(tmp)
        raise CorpusError(
            f"val_fraction={val_fraction} puts none of the {splits['train']['documents']} documents in the "
            "validation split; raise it or add documents"
        )
    meta = {
        "source": source,
        "dtype": dtype.name,
        "splits": splits,
        "tokenizer": {
            "name": tokenizer.name,
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    if output.exists():  # swap in the new directory; the old one goes only once the new one is in place
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        os.replace(output, old)
        os.replace(tmp, output)
        shutil.rmtree(old)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, output)
    counts = ", ".join(f"{s} {v['documents']:,} docs / {v['tokens']:,} tokens" for s, v in splits.items())
    print(f"data: prepared {output} with {tokenizer.name}: {counts}")
    return meta


@exit_on_error
def main() -> None:
    parser = cli.parser("python -m jaxllm.data.prepare", __doc__)
    parser.add_argument("--input", nargs="+", action="extend", required=True, help="globs, 'stdlib' or pkg:PKG/GLOB")
    parser.add_argument("--tokenizer", required=True, help="'gpt2' or a path to a tokenizer.json")
    parser.add_argument("--output", required=True)
    parser.add_argument("--val-fraction", type=float, default=0.02)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    prepare(args.input, args.tokenizer, args.output, args.val_fraction, args.workers)


if __name__ == "__main__":
    main()
