"""Prepared token shards → packed, shuffled, process-sharded batches, on grain.

Text: documents are packed back to back (they are stored that way) and cut into windows of
`seq_len + 1` tokens anywhere. Chat and prompt_completion: whole examples are packed greedily, in
order, into windows of `seq_len + 1` tokens (an example never crosses a window; one longer than a
window is truncated, or refused with `overlong='error'`), the rest padded in a segment of its own.
Each window carries segment ids and positions, so attention never crosses a document, and a loss
mask: no target that belongs to the next document, and for examples only the targets their stored
mask marks. Windows are shuffled globally with a seed, anew every epoch; JAX process p of P reads
windows p, p+P, ...; batches are prefetched by background threads. The iterator's state is a small
dict, saved in checkpoints, and the batches after a restore are bit-identical.
"""

from __future__ import annotations

import pathlib

import grain
import jax
import numpy as np

from jaxllm import logs
from jaxllm.data.prepare import read_meta
from jaxllm.errors import JaxllmError

log = logs.get(__name__)


class DataError(JaxllmError):
    """Prepared data that cannot serve this run; the message says why and what to do."""


OVERLONG = ("truncate", "error")


def _meta(directory: pathlib.Path) -> dict:
    meta = read_meta(directory)
    if meta is None:
        raise DataError(f"{directory} holds no prepared data (no meta.json); run python -m jaxllm.data.prepare")
    return meta


class TokenWindows:
    """Random access to the `seq_len + 1`-token windows of one split (windows never span shards)."""

    def __init__(self, directory: str | pathlib.Path, split: str, seq_len: int):
        directory = pathlib.Path(directory)
        meta = _meta(directory)
        self.seq_len = seq_len
        self.shards = [
            np.memmap(directory / s["file"], dtype=meta["dtype"], mode="r", shape=(s["tokens"],))
            for s in meta["splits"][split]["shards"]
        ]
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.offsets = np.cumsum([0, *counts])
        if self.offsets[-1] == 0:
            raise DataError(f"the {split} split of {directory} is shorter than one window of {seq_len + 1} tokens")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        start = (index - int(self.offsets[shard])) * self.seq_len
        return np.asarray(self.shards[shard][start : start + self.seq_len + 1], np.int32)


class ExampleWindows:
    """The windows of one split of chat or prompt_completion data: whole examples packed greedily,
    each with its stored mask; `[i]` is window i's model inputs (see `pack_examples`)."""

    def __init__(self, directory: str | pathlib.Path, split: str, seq_len: int, overlong: str = "truncate"):
        directory = pathlib.Path(directory)
        meta = _meta(directory)
        self.length, self.pad_id = seq_len + 1, meta["tokenizer"]["pad_id"]
        self.shards, self.windows = [], []  # windows: (shard, first example, end example)
        lengths = []
        for k, s in enumerate(meta["splits"][split]["shards"]):
            stem = directory / s["file"].removesuffix(".bin")
            tokens = np.memmap(directory / s["file"], dtype=meta["dtype"], mode="r", shape=(s["tokens"],))
            mask = np.memmap(stem.with_suffix(".mask"), dtype=np.uint8, mode="r", shape=(s["tokens"],))
            lens = np.fromfile(stem.with_suffix(".lens"), dtype=np.int32)
            self.shards.append((tokens, mask, np.concatenate([[0], np.cumsum(lens)]), np.minimum(lens, self.length)))
            self.windows += [(k, a, b) for a, b in _greedy(self.shards[-1][3], self.length)]
            lengths.append(lens)
        lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
        if not self.windows:
            raise DataError(f"the {split} split of {directory} holds no examples; prepare it again")
        if over := int((lengths > self.length).sum()):
            what = f"{over:,} of {len(lengths):,} {split} examples are longer than {self.length} tokens"
            if overlong == "error":
                raise DataError(f"{what} (train.seq_len + 1); raise train.seq_len, shorten them, or set "
                                "data.overlong='truncate'")  # fmt: skip
            if jax.process_index() == 0:
                log.warning(f"data: {what}; truncated")

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard, first, end = self.windows[index]
        tokens, mask, starts, lens = self.shards[shard]
        window = np.full(self.length, self.pad_id, np.int32)
        learn = np.zeros(self.length, np.uint8)
        segment = np.full(self.length, end - first + 1, np.int32)  # the padding: a segment of its own
        at = 0
        for j, e in enumerate(range(first, end)):
            n, start = int(lens[e]), int(starts[e])
            window[at : at + n], learn[at : at + n] = tokens[start : start + n], mask[start : start + n]
            segment[at : at + n] = j + 1
            at += n
        return pack_examples(window, segment, learn)


def _greedy(lens: np.ndarray, length: int) -> list[tuple[int, int]]:
    """[first, end) examples of each window: in order, a new window when the next does not fit."""
    bounds, fill = [], length
    for e, n in enumerate(lens.tolist()):
        if fill + n > length:
            bounds.append(e)
            fill = 0
        fill += n
    return list(zip(bounds, [*bounds[1:], len(lens)], strict=True))


def pack_examples(window: np.ndarray, segment: np.ndarray, learn: np.ndarray) -> dict[str, np.ndarray]:
    """Model inputs for one window of `seq_len + 1` tokens, given each token's segment (document)
    and whether it is learned: a target counts if it is in its input's segment and learned."""
    seg_in, seg_target = segment[:-1], segment[1:]
    index = np.arange(len(seg_in), dtype=np.int32)
    starts = np.concatenate([[True], seg_in[1:] != seg_in[:-1]])
    positions = index - np.maximum.accumulate(np.where(starts, index, 0))
    return {
        "inputs": window[:-1],
        "targets": window[1:],
        "segment_ids": seg_in,
        "positions": positions.astype(np.int32),
        "loss_mask": ((seg_in == seg_target) & (learn[1:] > 0)).astype(np.float32),
    }


def pack(window: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Model inputs for one text window: a document ends at (and includes) its end-of-text token."""
    segment = 1 + np.concatenate([[0], np.cumsum(window[:-1] == eos_id)]).astype(np.int32)
    return pack_examples(window, segment, np.ones(len(window), np.uint8))


class _Packed:
    """A text split's windows as model inputs."""

    def __init__(self, windows: TokenWindows, eos_id: int):
        self.windows, self.eos_id = windows, eos_id

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return pack(self.windows[index], self.eos_id)


def windows(directory: str | pathlib.Path, split: str, seq_len: int, eos_id: int, overlong: str = "truncate"):
    """A split's windows, as model inputs, for the format the data was prepared in."""
    if _meta(pathlib.Path(directory)).get("format", "text") == "text":
        return _Packed(TokenWindows(directory, split, seq_len), eos_id)
    return ExampleWindows(directory, split, seq_len, overlong)


def train_batches(
    directory: str | pathlib.Path,
    seq_len: int,
    rows: int,
    seed: int,
    eos_id: int,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 4,
    overlong: str = "truncate",
) -> grain.DatasetIterator:
    """An endless iterator of this process's `rows`-row batches; `get_state()` / `set_state()`
    save and restore its position."""
    source = grain.MapDataset.source(windows(directory, "train", seq_len, eos_id, overlong))
    dataset = (
        source.shuffle(seed=seed)
        .repeat()[
            # a fresh permutation each epoch
            process_index::process_count
        ]
        .batch(rows, drop_remainder=True)
    )
    options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))


def eval_batches(
    directory: str | pathlib.Path, seq_len: int, rows: int, count: int, eos_id: int, overlong: str = "truncate"
) -> list[dict]:
    """The same `count` validation batches every time: the first windows of the val split, wrapped
    around if it is short."""
    val = windows(directory, "val", seq_len, eos_id, overlong)
    examples = [val[i % len(val)] for i in range(rows * count)]
    return [
        {k: np.stack([e[k] for e in examples[b * rows : (b + 1) * rows]]) for k in examples[0]} for b in range(count)
    ]
