"""Where text comes from: input patterns → files → documents.

Patterns are globs, plus two names that work offline on any machine:
- `stdlib`: the Python standard library's sources and documentation (`pydoc_data`), without
  site-packages, the test suites and the codec tables;
- `pkg:PACKAGE/GLOB`: files inside an installed package, e.g. `pkg:shksprdata/texts/*_gut.txt`.
A pattern may also match a Hugging Face dataset saved to disk (a directory with `state.json`).
Records come from `.jsonl` lines, Parquet rows and dataset rows alike; other files are one text each.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import pathlib
import sysconfig
from collections.abc import Iterator

from jaxllm.data import tables
from jaxllm.errors import JaxllmError

# Installed packages, test suites, and the codec tables in `encodings` (repetitive generated code).
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings"}


class CorpusError(JaxllmError):
    """Inputs that cannot be read; the message names the file or pattern and the fix."""


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [p for p in root.rglob("*.py") if not _STDLIB_SKIP & set(p.relative_to(root).parts)]


def _package_files(pattern: str) -> list[pathlib.Path]:
    package, _, rest = pattern.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"input {'pkg:' + pattern!r}: package {package!r} is not installed; pip install it first")
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    return [pathlib.Path(p) for p in glob.glob(str(root / rest), recursive=True)]


def resolve_inputs(patterns: list[str]) -> list[pathlib.Path]:
    """Sorted, de-duplicated files (and saved datasets) for the patterns; every pattern must match
    at least one. The files inside a matched dataset are read through it, never on their own."""
    files: set[pathlib.Path] = set()
    for pattern in patterns:
        if pattern == "stdlib":
            found = _stdlib_files()
        elif pattern.startswith("pkg:"):
            found = _package_files(pattern[4:])
        else:
            found = [pathlib.Path(p) for p in glob.glob(pattern, recursive=True)]
        found = [p for p in found if p.is_file() or tables.is_hf_dataset(p)]
        if not found:
            raise CorpusError(f"input pattern {pattern!r} matches no files; check the path or glob")
        files.update(p.resolve() for p in found)
    datasets = [p for p in files if p.is_dir()]
    return sorted(p for p in files if not any(d in p.parents for d in datasets))


def work_units(path: pathlib.Path) -> list[tuple[pathlib.Path, int | None]]:
    """What one worker reads at a time: a Parquet row group, a dataset's Arrow file, else the file."""
    if path.suffix == ".parquet" or tables.is_hf_dataset(path):
        return tables.units(path)
    return [(path, None)]


def _read_text(path: pathlib.Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"cannot read input file {path}: {e.strerror}; fix its permissions or leave it out") from e
    return raw.decode("utf-8", errors="replace")


def read_records(
    unit: tuple[pathlib.Path, int | None], fields: list[str], optional: tuple[str, ...] = ()
) -> Iterator[tuple[str, dict]]:
    """(key, record) for each record of a work unit: a `.jsonl` line (key file:line), a Parquet or
    dataset row (key file:row N). A record's fields are checked where it is used."""
    path, group = unit
    if path.suffix in (".parquet", ".arrow"):
        yield from tables.rows(path, group, fields, optional)
        return
    if path.suffix != ".jsonl":
        raise CorpusError(f"{path}: records come from .jsonl, .parquet or a saved Hugging Face dataset; convert it")
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{number}: not valid JSON ({e.msg}); each line must be an object") from e
        if not isinstance(record, dict):
            raise CorpusError(f"{path}:{number}: not a JSON object; each line must be an object")
        yield f"{path}:{number}", record


def read_texts(unit: tuple[pathlib.Path, int | None], field: str = "text") -> Iterator[tuple[str, str]]:
    """(key, text) for each document of a work unit in the text format: a record's `field`, or
    a whole file that holds no records. Empty documents are skipped."""
    path = unit[0]
    if path.suffix not in (".jsonl", ".parquet", ".arrow"):
        if (text := _read_text(path)).strip():
            yield str(path), text
        return
    for key, record in read_records(unit, [field]):
        if not isinstance(record.get(field), str):
            raise CorpusError(f"{key}: needs a string field {field!r}; name the text field with data.text_field")
        if record[field].strip():
            yield key, record[field]


def read_documents(path: pathlib.Path, field: str = "text") -> Iterator[tuple[str, str]]:
    """(key, text) for each document of an input in the text format: one per `.jsonl` line, Parquet
    or dataset row (its `field`), else the whole file. Bytes that are not UTF-8 are replaced, never fatal."""
    for unit in work_units(path):
        yield from read_texts(unit, field)
