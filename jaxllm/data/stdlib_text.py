"""Interim training text: the Python standard library's own sources, read as bytes.

Every machine with Python has this text, so the tiny model trains offline anywhere. Tokens are
bytes (0-255) plus an end-of-document id.
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np


class ByteTokenizer:
    """Bytes are tokens; id 256 ends a document."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def stdlib_tokens(max_bytes: int) -> np.ndarray:
    """Byte tokens of stdlib `.py` files (site-packages left out), in a fixed order, with
    end-of-document ids between files, up to `max_bytes`."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}: the stdlib corpus needs a standard CPython install")
    chunks, size = [], 0
    for path in files:
        data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.uint16)
        chunks += [data, np.array([ByteTokenizer.eos_id], np.uint16)]
        size += data.size + 1
        if size >= max_bytes:
            break
    return np.concatenate(chunks)[:max_bytes]


def random_windows(
    tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, start_step: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of random `seq_len + 1` windows; batch k depends only on (seed, k), so a run is
    reproducible and can restart at any step."""
    step = start_step
    while True:
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, tokens.size - seq_len - 1, size=batch_size)
        windows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        yield {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
        step += 1
