"""The machinery of a config section: a frozen dataclass built from a mapping (unknown fields
refused by name, Literal choices checked), written back as plain dicts, changed by copy; and the
one error type, whose message names the field, its value and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Mapping, MutableMapping
from typing import Any, ClassVar, Literal

import ml_collections

from jaxllm.errors import JaxllmError


class ConfigError(JaxllmError):
    """A setting that cannot work; the message says which field and how to fix it."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def no_such_field(name: str, known: typing.Iterable[str], at: int = -1) -> ConfigError:
    """The refusal of the setting `name` (dotted, as written) whose part `at` is not among `known`
    (the names beside it), naming the field it most likely meant."""
    parts = name.split(".")
    near = difflib.get_close_matches(parts[at], list(known), n=1)
    hint = f"did you mean {'.'.join(parts[:at] + near + parts[at:][1:])}? " if near else ""
    return ConfigError(f"{name}: the config has no such field; {hint}see a command's --help for the fields")


def field(default: Any, help: str) -> Any:
    """A setting with its one-line description (what `--help` shows)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Section:
    """A section of settings: built from a mapping (unknown fields refused by name), written back
    as a plain dict, changed by copy."""

    name: ClassVar[str]

    def __post_init__(self) -> None:
        for name, allowed in _allowed(type(self)).items():
            value = getattr(self, name)
            require(value in allowed, f"{self.name}.{name}={value!r} is unknown; use one of {allowed}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> typing.Self:
        hints = _hints(cls)
        for key in values:
            if key not in hints:
                raise no_such_field(f"{cls.name}.{key}", hints)
        kwargs = {}
        for key, value in values.items():
            kind = hints[key]
            kwargs[key] = kind.from_dict(value) if isinstance(kind, type) and issubclass(kind, Section) else value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The settings as written: plain values, each section a dict."""
        return {f.name: _written(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> typing.Self:
        """A copy with `changes` (a nested section as a section or a dict), built and checked anew."""
        return type(self).from_dict(self.to_dict() | {k: _written(v) for k, v in changes.items()})


@functools.cache
def _hints(cls: type[Section]) -> dict[str, Any]:
    """Each field's type, resolved once per class: resolving is most of the time a section takes
    to build, and the planner's search builds thousands."""
    resolved = typing.get_type_hints(cls)
    return {f.name: resolved[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def _allowed(cls: type[Section]) -> dict[str, tuple]:
    """The fields of `cls` that take one of a few values, with those values."""
    return {name: allowed for name, kind in _hints(cls).items() if (allowed := _choices(kind))}


def _written(value: Any) -> Any:
    return value.to_dict() if isinstance(value, Section) else value


def _choices(kind: Any) -> tuple:
    """The allowed values of a Literal type (with None if it is optional), else (): any."""
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if all(typing.get_origin(a) is Literal for a in args):
            return (*(c for a in args for c in typing.get_args(a)), None)
    return ()


def _plain(values: Any) -> Any:
    """A ConfigDict (or any mapping) as nested plain dicts."""
    if isinstance(values, ml_collections.ConfigDict):
        return values.to_dict()
    return {k: _plain(v) for k, v in values.items()} if isinstance(values, Mapping) else values


def _merged(base: dict, changes: Mapping) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, Mapping) else value
    return out


def apply_overrides(cfg: MutableMapping, overrides: Mapping[str, Any]) -> MutableMapping:
    """Sets dotted fields ('serve.slots': 4) on `cfg` (a ConfigDict, or nested dicts) and returns it;
    refuses names it does not have."""
    for name, value in overrides.items():
        parts, node = name.split("."), cfg
        for i, part in enumerate(parts):
            known = node.keys() if hasattr(node, "keys") else ()
            if part not in known:
                raise no_such_field(f"--config.{name}", known, at=i + 1)
            if i < len(parts) - 1:
                node = node[part]
        node[parts[-1]] = value
    return cfg
