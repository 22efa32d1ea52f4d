"""Columnar corpora: Parquet files, read one row group at a time (a row group is one worker's
unit), and Hugging Face datasets saved with `datasets`' `save_to_disk` (a directory whose
`state.json` lists its Arrow IPC stream files, `data-XXXXX-of-YYYYY.arrow`)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

from jaxllm.errors import JaxllmError


class TableError(JaxllmError):
    """A Parquet file or saved dataset that cannot be read; the message names it and the fix."""


def is_hf_dataset(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file()


def hf_data_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The dataset's Arrow files, in its own order (state.json's `_data_files`)."""
    try:
        state = json.loads((directory / "state.json").read_text())
        files = [directory / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TableError(
            f"{directory}/state.json does not list the dataset's files ({e}); save it again with "
            "datasets' Dataset.save_to_disk"
        ) from e
    if missing := [str(f) for f in files if not f.is_file()]:
        raise TableError(f"{directory}: state.json names files that are not there: {missing}; save it again")
    return files


def units(path: pathlib.Path) -> list[tuple[pathlib.Path, int | None]]:
    """The pieces workers read on their own: a Parquet file's row groups, a dataset's Arrow files."""
    if is_hf_dataset(path):
        return [(f, None) for f in hf_data_files(path)]
    import pyarrow.parquet as pq

    try:
        groups = pq.ParquetFile(path).num_row_groups
    except Exception as e:  # pyarrow's errors for a file that is not Parquet have several kinds
        raise TableError(f"{path} is not a readable Parquet file ({e}); rewrite it or leave it out") from e
    return [(path, g) for g in range(groups)]


def _columns(path: pathlib.Path, schema_names: list[str], wanted: list[str], optional: tuple[str, ...]) -> list[str]:
    if missing := [c for c in wanted if c not in schema_names]:
        raise TableError(
            f"{path}: no column {missing[0]!r} (it has {', '.join(schema_names)}); name the text column with "
            "data.text_field, or set data.format to the format the file holds"
        )
    return wanted + [c for c in optional if c in schema_names]


def _plain(value):
    """A value as JSON would give it: Arrow structs carry every field of the column's type, so the
    ones a record does not have come back as None and are left out here."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def rows(
    path: pathlib.Path, group: int | None, columns: list[str], optional: tuple[str, ...] = ()
) -> Iterator[tuple[str, dict]]:
    """(key, record) for each row of a Parquet row group or an Arrow stream file; the key names
    the file and the row (counted from 0 in the file)."""
    import pyarrow as pa

    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        names = _columns(path, file.schema_arrow.names, columns, optional)
        first = sum(file.metadata.row_group(g).num_rows for g in range(group))
        batches = [file.read_row_group(group, columns=names)]
    else:
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        except pa.ArrowInvalid as e:
            raise TableError(f"{path} is not an Arrow IPC stream ({e}); save the dataset again") from e
        names = _columns(path, reader.schema.names, columns, optional)
        first, batches = 0, reader
    row = first
    for batch in batches:
        values = {name: batch.column(name).to_pylist() for name in names}
        for i in range(batch.num_rows):
            yield f"{path}:row {row}", {name: _plain(values[name][i]) for name in names}
            row += 1
