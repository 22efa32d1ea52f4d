"""Prepared token shards → packed, shuffled, process-sharded batches, on grain.

Documents are packed back to back (they are stored that way) and cut into windows of
`seq_len + 1` tokens. Each window carries segment ids and positions, so attention never crosses a
document boundary, and a loss mask that skips the one target in each boundary that belongs to the
next document. Windows are shuffled globally with a seed, anew every epoch; JAX process p of P
reads windows p, p+P, ...; batches are prefetched by background threads. The iterator's state is
a small dict, saved in checkpoints, and the batches after a restore are bit-identical.
"""

from __future__ import annotations

import pathlib

import grain
import numpy as np

from jaxllm.data.prepare import read_meta
from jaxllm.errors import JaxllmError


class DataError(JaxllmError):
    """Prepared data that cannot serve this run; the message says why and what to do."""


class TokenWindows:
    """Random access to the `seq_len + 1`-token windows of one split (windows never span shards)."""

    def __init__(self, directory: str | pathlib.Path, split: str, seq_len: int):
        directory = pathlib.Path(directory)
        meta = read_meta(directory)
        if meta is None:
            raise DataError(f"{directory} holds no prepared data (no meta.json); run python -m jaxllm.data.prepare")
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


def pack(window: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Model inputs for one window: a document ends at (and includes) its end-of-text token."""
    segment = 1 + np.concatenate([[0], np.cumsum(window[:-1] == eos_id)]).astype(np.int32)
    seg_in, seg_target = segment[:-1], segment[1:]
    index = np.arange(len(seg_in), dtype=np.int32)
    starts = np.concatenate([[True], seg_in[1:] != seg_in[:-1]])
    positions = index - np.maximum.accumulate(np.where(starts, index, 0))
    return {
        "inputs": window[:-1],
        "targets": window[1:],
        "segment_ids": seg_in,
        "positions": positions.astype(np.int32),
        "loss_mask": (seg_in == seg_target).astype(np.float32),
    }


def train_batches(
    directory: str | pathlib.Path,
    seq_len: int,
    rows: int,
    seed: int,
    eos_id: int,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 4,
) -> grain.DatasetIterator:
    """An endless iterator of this process's `rows`-row batches; `get_state()` / `set_state()`
    save and restore its position."""
    windows = grain.MapDataset.source(TokenWindows(directory, "train", seq_len))
    dataset = (
        windows.shuffle(seed=seed)
        .repeat()[
            # a fresh permutation each epoch
            process_index::process_count
        ]
        .map(lambda w: pack(w, eos_id))
        .batch(rows, drop_remainder=True)
    )
    options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))


def eval_batches(directory: str | pathlib.Path, seq_len: int, rows: int, count: int, eos_id: int) -> list[dict]:
    """The same `count` validation batches every time: the first windows of the val split, wrapped
    around if it is short."""
    windows = TokenWindows(directory, "val", seq_len)
    examples = [pack(windows[i % len(windows)], eos_id) for i in range(rows * count)]
    return [
        {k: np.stack([e[k] for e in examples[b * rows : (b + 1) * rows]]) for k in examples[0]} for b in range(count)
    ]
