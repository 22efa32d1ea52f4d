"""One command-line style for every entry point: argparse, built when the command runs (nothing
at import time). Commands that take a run's config add `--config FILE` (a `configs/*.py` whose
`get_config()` returns a ConfigDict) and dotted overrides, `--config.train.steps=50` or
`--config.train.steps 50`, each parsed by its field's type; `--help` lists every field with its
type, default and description. The typed config is built from them once, here, at the edge.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from jaxllm import logs
from jaxllm.config import ConfigError, RunConfig, Section, no_such_field

OVERRIDE = "--config."
TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0")
KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def parser(prog: str, doc: str, sections: Sequence[type[Section]] = ()) -> argparse.ArgumentParser:
    """A command's parser, its description the first line of `doc`. With `sections` (e.g.
    RunConfig), `--help` ends with the fields `--config.x.y=v` can set."""
    epilog = None
    if sections:
        rows = [row for s in sections for row in _field_rows(s, "" if s is RunConfig else s.name)]
        epilog = "config fields (--config.FIELD=VALUE):\n" + "\n".join(rows)
    return argparse.ArgumentParser(
        prog=prog, description=doc.strip().split("\n")[0], epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip


def add_logging(parser: argparse.ArgumentParser) -> None:
    """The switches of jaxllm's logger (see `jaxllm.logs`), set by `parse_logging`."""
    parser.add_argument("--log-all-processes", action="store_true", help="log from every process of a job, not 0 only")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines: time, level, process, logger, message")


def parse_logging(args: argparse.Namespace) -> None:
    logs.configure(args.log_all_processes, args.log_json)


def _field_rows(section: type[Section], prefix: str) -> list[str]:
    rows = []
    for f, kind in _fields(section):
        name = f"{prefix}.{f.name}" if prefix else f.name
        if _is_section(kind):
            rows += _field_rows(kind, name)
        else:
            rows.append(f"  {name:<36} {_type_name(kind):<12} {f.default!r:<22} {f.metadata.get('help', '')}")
    return rows


def _fields(section: type[Section]) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(section)
    return [(f, hints[f.name]) for f in dataclasses.fields(section)]


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Section)


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is Literal:
        return "|".join(map(str, typing.get_args(kind)))
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return "|".join(_type_name(a) for a in typing.get_args(kind))
    return "None" if kind is type(None) else kind.__name__


def split_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(the other arguments, {dotted field: its text}) of a command line."""
    rest, overrides, args = [], {}, list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith(OVERRIDE):
            rest.append(arg)
            continue
        name, has_value, value = arg[len(OVERRIDE) :].partition("=")
        if not has_value:
            if not args:
                raise ConfigError(f"{arg} has no value; write {arg}=VALUE")
            value = args.pop(0)
        overrides[name] = value
    return rest, overrides


def typed_overrides(texts: dict[str, str], sections: Sequence[type[Section]] = (RunConfig,)) -> dict[str, Any]:
    """Each override's text parsed by its field's type (found in `sections`, by name)."""
    roots = {s.name: s for s in sections if s is not RunConfig}
    out = {}
    for name, text in texts.items():
        head, _, rest = name.partition(".")
        section, path = (roots[head], rest) if head in roots else (RunConfig, name)
        out[name] = _parse(name, text, _field_type(section, path, name))
    return out


def _field_type(section: type[Section], path: str, name: str) -> Any:
    kind: Any = section
    before = name.count(".") - path.count(".")  # the section's name, when `name` starts with it
    for i, part in enumerate(path.split(".")):
        hints = typing.get_type_hints(kind) if _is_section(kind) else {}
        if part not in hints or part == "name":
            raise no_such_field(f"--config.{name}", set(hints) - {"name"}, at=1 + before + i)
        kind = hints[part]
    if _is_section(kind):
        raise ConfigError(f"--config.{name} is a section; set one of its fields (see --help)")
    return kind


def _parse(name: str, text: str, kind: Any) -> Any:
    """`text` as a value of `kind` (bool, int, float, str, a Literal, or one of them | None)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if text == "None":
            return None
        return _parse(name, text, next(a for a in args if a is not type(None)))
    if typing.get_origin(kind) is Literal:
        return _parse(name, text, type(args[0]))
    try:
        if kind is bool:
            if text.lower() not in TRUE + FALSE:
                raise ValueError
            return text.lower() in TRUE
        return kind(text)
    except ValueError:
        raise ConfigError(f"--config.{name}={text}: the field takes {KINDS[kind]}; give one") from None


def quiet_jax_logs() -> None:
    """JAX probes for every backend at start-up and logs each miss at INFO; only real problems matter."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
