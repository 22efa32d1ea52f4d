"""Where text comes from: input patterns → files → documents.

Patterns are globs, plus two names that work offline on any machine:
- `stdlib`: the Python standard library's sources and documentation (`pydoc_data`), without
  site-packages, the test suites and the codec tables;
- `pkg:PACKAGE/GLOB`: files inside an installed package, e.g. `pkg:shksprdata/texts/*_gut.txt`.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import pathlib
import sysconfig
from collections.abc import Iterator

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
    """Sorted, de-duplicated files for the patterns; every pattern must match at least one file."""
    files: set[pathlib.Path] = set()
    for pattern in patterns:
        if pattern == "stdlib":
            found = _stdlib_files()
        elif pattern.startswith("pkg:"):
            found = _package_files(pattern[4:])
        else:
            found = [pathlib.Path(p) for p in glob.glob(pattern, recursive=True)]
        found = [p for p in found if p.is_file()]
        if not found:
            raise CorpusError(f"input pattern {pattern!r} matches no files; check the path or glob")
        files.update(p.resolve() for p in found)
    return sorted(files)


def read_documents(path: pathlib.Path) -> Iterator[tuple[str, str]]:
    """(key, text) for each document: one per `.jsonl` line (its `text` field), else the whole
    file. Bytes that are not UTF-8 are replaced, never fatal."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"cannot read input file {path}: {e.strerror}; fix its permissions or leave it out") from e
    text = raw.decode("utf-8", errors="replace")
    if path.suffix != ".jsonl":
        if text.strip():
            yield str(path), text
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{number}: not valid JSON ({e.msg}); each line must be an object") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CorpusError(f"{path}:{number}: needs a string field 'text'")
        if record["text"].strip():
            yield f"{path}:{number}", record["text"]
