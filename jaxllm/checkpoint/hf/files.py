"""Hugging Face weight files: one `model.safetensors`, or shards listed by
`model.safetensors.index.json`. Both directions go a tensor at a time: a read opens the file for
that one tensor (its pages leave the process with it), and a write streams each tensor's bytes
after a header written first, since every name, dtype and shape is known before any data (the
safetensors library's writer would want a whole file's tensors in memory at once)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Callable, Iterable

import ml_dtypes  # noqa: F401  (names bfloat16 for numpy)
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxllm.checkpoint.hf.config import ConversionError, read_json

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class WeightFiles:
    """The tensors of a Hugging Face model directory: names, shapes, dtypes, and one at a time."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        index, single = read_json(self.directory / INDEX), self.directory / SINGLE
        if index is not None and single.is_file():
            raise ConversionError(f"{self.directory} has both {SINGLE} and {INDEX} (readers disagree on which "
                                  "counts); remove the stale one")  # fmt: skip
        if index is not None:
            if not isinstance(index.get("weight_map"), dict):
                raise ConversionError(f"{self.directory / INDEX} has no weight_map; download the model's index again")
            files = {name: self.directory / file for name, file in index["weight_map"].items()}
        elif single.is_file():
            files = dict.fromkeys(self._open(single).keys(), single)
        else:
            raise ConversionError(
                f"{self.directory} has neither {SINGLE} nor {INDEX}; pass a Hugging Face model directory saved as "
                "safetensors (a PyTorch .bin one converts with transformers' save_pretrained(DIR, "
                "safe_serialization=True))"
            )
        self.file, self.shape, self.dtype = files, {}, {}
        for path in sorted(set(files.values())):
            reader = self._open(path)
            for name in reader.keys():
                piece = reader.get_slice(name)
                self.shape[name], self.dtype[name] = tuple(piece.get_shape()), piece.get_dtype()
        missing = sorted(n for n in files if n not in self.shape)
        if missing:
            raise ConversionError(f"{self.directory / INDEX} lists {missing[:3]} in files that do not hold them; "
                                  "download the model's shards again")  # fmt: skip

    def _open(self, path: pathlib.Path):
        if not path.is_file():
            raise ConversionError(f"{path} is missing; download the model's shards again")
        try:
            return safe_open(path, framework="np")
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{path} is not a readable safetensors file ({e}); download it again") from e

    def names(self) -> set[str]:
        return set(self.file)

    def read(self, name: str) -> np.ndarray:
        try:
            return self._open(self.file[name]).get_tensor(name)
        except SafetensorError as e:
            raise ConversionError(f"{self.file[name]}: tensor {name} cannot be read ({e}); download it again") from e


def write_weights(
    directory: pathlib.Path,
    tensors: Iterable[tuple[str, tuple[int, ...]]],
    produce: Callable[[str], np.ndarray],
    dtype: str,
    max_shard_bytes: int,
) -> list[pathlib.Path]:
    """Writes the named tensors of the given shapes, all in `dtype`, each from `produce(name)` in
    turn, into one `model.safetensors` or, past `max_shard_bytes`, shards and their index."""
    itemsize = np.dtype(dtype).itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    names = [SINGLE] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(1, len(shards) + 1)]  # fmt: skip
    for file, shard in zip(names, shards, strict=True):
        _write_file(directory / file, shard, produce, dtype)
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards, strict=True) for name, _ in shard}
        total = sum(math.prod(shape) * itemsize for shard in shards for _, shape in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2))
    return [directory / f for f in names]


def _write_file(path: pathlib.Path, shard: list, produce: Callable[[str], np.ndarray], dtype: str) -> None:
    """One safetensors file: an 8-byte header length, the JSON header (space-padded to 8 bytes),
    then each tensor's little-endian bytes in header order. Written beside and renamed when
    whole, so a file that is there is complete."""
    itemsize, header, offset = np.dtype(dtype).itemsize, {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shard:
        end = offset + math.prod(shape) * itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    partial = path.with_name(f".{path.name}.partial")
    little = np.dtype(dtype).newbyteorder("<")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape in shard:
            array = np.ascontiguousarray(produce(name), dtype=little)
            if array.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {array.shape}, declared {shape}")
            f.write(array.reshape(-1).view(np.uint8).data)
    os.replace(partial, path)
