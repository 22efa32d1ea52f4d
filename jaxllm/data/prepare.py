"""Text, chats or prompt/completion pairs → token shards on disk, tokenized in worker processes.

    python -m jaxllm.data.prepare --input 'corpus/*.jsonl' --tokenizer gpt2 --output data/corpus

Layout of the output directory (raw little-endian arrays that `np.memmap` opens without copying):
- `{split}-{k:05d}.bin`: tokens of whole documents (text: each followed by the end-of-text id;
  chat and prompt_completion: whole examples, see `jaxllm.data.examples`);
- `{split}-{k:05d}.lens`: each document's length in tokens (int32), in order;
- `{split}-{k:05d}.mask`: for chat and prompt_completion, 1 (uint8) on each token the model learns;
- `{split}.docs`: the key of every document in that split (file, file:line, or file:row N);
- `meta.json`: the data format, tokenizer identity and hash, dtype, shard token counts, document
  counts, and the inputs it was made from. Running it again on unchanged inputs does nothing.
Documents go to `val` by a hash of their key below the inputs' common directory, so the split is
stable, disjoint by document, and the same wherever the corpus lies (another mount, another
workdir).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pathlib
import shutil
import zlib

import numpy as np
from tqdm import tqdm

from jaxllm import cli, logs
from jaxllm.data import examples
from jaxllm.data.chat import ChatTemplate, special_tokens
from jaxllm.data.corpus import CorpusError, read_records, read_texts, resolve_inputs, work_units
from jaxllm.data.tokenizer import Tokenizer, get_tokenizer
from jaxllm.errors import exit_on_error

log = logs.get(__name__)

FORMAT = 2
SPLITS = ("train", "val")
SHARD_TOKENS = 1 << 28

_worker = {}


def split_of(key: str, val_fraction: float) -> str:
    return "val" if zlib.crc32(key.encode()) % 100_000 < val_fraction * 100_000 else "train"


def chat_template(tokenizer: Tokenizer, path: str | None) -> ChatTemplate:
    """The template chats are rendered with: the file at `path`, else the tokenizer's, else the
    built-in one; serving chooses the same way."""
    return ChatTemplate.chosen(path, tokenizer.chat_template, special_tokens(tokenizer), "data.chat_template")


def _init_worker(tokenizer_spec: str, data_format: str, text_field: str, template: str | None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = get_tokenizer(tokenizer_spec)
    _worker.update(tokenizer=tokenizer, format=data_format, text_field=text_field)
    if data_format == "chat":
        _worker["template"] = chat_template(tokenizer, template)


def _tokenize_unit(unit: tuple[pathlib.Path, int | None]) -> list[tuple[str, list[int], np.ndarray | None]]:
    """(key, ids, mask) for each document of one work unit; mask is None for text."""
    tokenizer, data_format = _worker["tokenizer"], _worker["format"]
    if data_format == "text":
        docs = list(read_texts(unit, _worker["text_field"]))
        ids = tokenizer.encode_batch([text for _, text in docs])
        # Each document as its model's tokenizer starts a text (a Llama's bos), then eos.
        start, end = list(tokenizer.prompt_prefix), [tokenizer.eos_id]
        return [(key, start + doc + end, None) for (key, _), doc in zip(docs, ids, strict=True)]
    records = list(read_records(unit, examples.FIELDS[data_format], examples.OPTIONAL[data_format]))
    if data_format == "chat":
        encoded = [examples.encode_chat(tokenizer, _worker["template"], key, r) for key, r in records]
    else:
        encoded = examples.encode_prompt_completions(tokenizer, records)
    return [(key, ids, mask) for (key, _), (ids, mask) in zip(records, encoded, strict=True)]


class _ShardWriter:
    def __init__(self, directory: pathlib.Path, split: str, dtype: np.dtype, masked: bool):
        self.directory, self.split, self.dtype, self.masked = directory, split, dtype, masked
        self.shards: list[dict] = []
        self.keys: list[str] = []
        self._files = []

    def add(self, key: str, ids: list[int], mask: np.ndarray | None) -> None:
        if not self._files or self.shards[-1]["tokens"] + len(ids) > SHARD_TOKENS:
            self._roll()
        np.asarray(ids, self.dtype).tofile(self._files[0])
        np.asarray([len(ids)], np.int32).tofile(self._files[1])
        if self.masked:
            np.asarray(mask, np.uint8).tofile(self._files[2])
        self.shards[-1]["tokens"] += len(ids)
        self.shards[-1]["documents"] += 1
        self.keys.append(key)

    def _roll(self) -> None:
        for file in self._files:
            file.close()
        name = f"{self.split}-{len(self.shards):05d}"
        suffixes = (".bin", ".lens", ".mask") if self.masked else (".bin", ".lens")
        self._files = [open(self.directory / (name + suffix), "wb") for suffix in suffixes]
        self.shards.append({"file": name + ".bin", "tokens": 0, "documents": 0})

    def close(self) -> dict:
        for file in self._files:
            file.close()
        (self.directory / f"{self.split}.docs").write_text("".join(k + "\n" for k in self.keys))
        return {"shards": self.shards, "documents": len(self.keys), "tokens": sum(s["tokens"] for s in self.shards)}


def _stats(path: pathlib.Path) -> list:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def _source(files: list[pathlib.Path], tokenizer, val_fraction: float, data: dict) -> dict:
    """What the output depends on: if this is unchanged, the output is already right."""
    stats = [s for f in files for s in _stats(f)]
    return {
        "format": FORMAT,
        **data,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "val_fraction": val_fraction,
        "inputs_fingerprint": zlib.crc32(json.dumps(stats).encode()),
        "files": len(files),
    }


def read_meta(directory: str | pathlib.Path) -> dict | None:
    path = pathlib.Path(directory) / "meta.json"
    return json.loads(path.read_text()) if path.exists() else None


def _tokenized(units: list, workers: int, setup: tuple):
    """Each unit's documents in order, from `workers` worker processes; one unit is tokenized here,
    where a spawned worker's start-up (importing the tokenizer stack) would cost more than it."""
    if workers == 1:
        _init_worker(*setup)
        yield from map(_tokenize_unit, units)
        return
    context = multiprocessing.get_context("spawn")  # never fork a process that may run JAX threads
    with context.Pool(workers, _init_worker, setup) as pool:
        yield from pool.imap(_tokenize_unit, units, chunksize=4)


def prepare(
    inputs: list[str],
    tokenizer_spec: str,
    output: str | pathlib.Path,
    val_fraction: float = 0.02,
    workers: int | None = None,
    progress: bool = True,
    data_format: str = "text",
    text_field: str = "text",
    template: str | None = None,
) -> dict:
    """Tokenizes `inputs` into `output` (atomically) and returns the metadata. `data_format`: what
    the inputs hold (`jaxllm.data.examples.FORMATS`); `text_field`: the text format's field or
    column; `template`: a Jinja chat template file for the chat format."""
    if data_format not in examples.FORMATS:
        raise CorpusError(f"data format {data_format!r} is not one of {', '.join(examples.FORMATS)}")
    output = pathlib.Path(output)
    files = resolve_inputs(inputs)
    tokenizer = get_tokenizer(tokenizer_spec)
    data = {"data_format": data_format}
    if data_format == "text":
        data["text_field"] = text_field
    if data_format == "chat":
        data["chat_template"] = hashlib.sha256(chat_template(tokenizer, template).source.encode()).hexdigest()
    source = _source(files, tokenizer, val_fraction, data)
    if (meta := read_meta(output)) is not None and meta["source"] == source:
        log.info(f"data: {output} is already prepared from these inputs")
        return meta
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writers = {split: _ShardWriter(tmp, split, dtype, data_format != "text") for split in SPLITS}
    units = [unit for f in files for unit in work_units(f)]
    corpus = os.path.commonpath([f.parent for f in files])
    workers = min(workers or min(8, os.cpu_count() or 1), len(units))
    try:
        with tqdm(total=len(units), unit="part", desc="tokenize", disable=not progress) as bar:
            for docs in _tokenized(units, workers, (tokenizer_spec, data_format, text_field, template)):
                for key, ids, mask in docs:
                    writers[split_of(os.path.relpath(key, corpus), val_fraction)].add(key, ids, mask)
                bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    splits = {split: w.close() for split, w in writers.items()}
    if splits["train"]["documents"] == 0:
        shutil.rmtree(tmp)
        what = "text documents" if data_format == "text" else f"{data_format} examples"
        raise CorpusError(f"inputs {inputs} contain no {what}; point data.inputs at such files")
    if val_fraction > 0 and splits["val"]["documents"] == 0:
        shutil.rmtree(tmp)
        raise CorpusError(
            f"val_fraction={val_fraction} puts none of the {splits['train']['documents']} documents in the "
            "validation split; raise it or add documents"
        )
    meta = {
        "format": data_format,
        "source": source,
        "dtype": dtype.name,
        "splits": splits,
        "tokenizer": {
            "name": tokenizer.name,
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "pad_id": tokenizer.pad_id,
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
    log.info(f"data: prepared {output} with {tokenizer.name}: {counts}")
    return meta


@exit_on_error
def main() -> None:
    parser = cli.parser("python -m jaxllm.data.prepare", __doc__)
    parser.add_argument("--input", nargs="+", action="extend", required=True, help="globs, 'stdlib' or pkg:PKG/GLOB")
    parser.add_argument("--tokenizer", required=True, help="'gpt2' or a path to a tokenizer.json")
    parser.add_argument("--output", required=True)
    parser.add_argument("--val-fraction", type=float, default=0.02)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--format", default="text", choices=examples.FORMATS, help="what the inputs hold")
    parser.add_argument("--text-field", default="text", help="the text format's JSONL field or Parquet/dataset column")
    parser.add_argument("--chat-template", help="a Jinja chat template file (default: the tokenizer's, else built in)")
    args = parser.parse_args()
    prepare(args.input, args.tokenizer, args.output, args.val_fraction, args.workers, True,
            args.format, args.text_field, args.chat_template)  # fmt: skip


if __name__ == "__main__":
    main()
