"""What users write: config files (`get_config()` returning an `ml_collections.ConfigDict`) and
dotted overrides, converted once into the typed `RunConfig`."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import typing
from collections.abc import Mapping
from typing import Any, Literal

import ml_collections
from ml_collections.config_dict import placeholder

from jaxllm.config.section import ConfigError, Section, apply_overrides
from jaxllm.config.sections import RunConfig


def base_config(*sections: type[Section]) -> ml_collections.ConfigDict:
    """What config files and `--config.x.y=v` overrides start from: every field of a run (and of
    the `sections` a tool adds, each under its name), with its default. A field whose default is
    None is a typed placeholder, so an override is checked against its type."""

    def as_dict(section: type[Section]) -> dict:
        hints = typing.get_type_hints(section)
        out = {}
        for f in dataclasses.fields(section):
            kind, default = hints[f.name], f.default
            if isinstance(kind, type) and issubclass(kind, Section):
                out[f.name] = as_dict(kind)
            elif default is None:
                out[f.name] = placeholder(_optional_type(kind))
            else:
                out[f.name] = default
        return out

    cfg = ml_collections.ConfigDict(as_dict(RunConfig))
    for section in sections:
        cfg[section.name] = as_dict(section)
    return cfg


def _optional_type(kind: Any) -> type:
    """The type a placeholder holds: T of `T | None` (str for a Literal's values)."""
    arg = next(a for a in typing.get_args(kind) if a is not type(None))
    return type(typing.get_args(arg)[0]) if typing.get_origin(arg) is Literal else arg


def load_config(path: str | pathlib.Path, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The run config of a config file, e.g. `configs/tiny.py` (paths relative to the repo root
    work too): its `get_config()`, with dotted `overrides` ({'train.steps': 5}) on top."""
    path = pathlib.Path(path)
    repo = pathlib.Path(__file__).parents[2]
    if not path.exists() and (repo / path).exists():
        path = repo / path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or not path.exists():
        raise ConfigError(f"config file {path} does not exist; pass a path such as configs/tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.get_config()
    if not isinstance(written, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config() returned a {type(written).__name__}; return a ConfigDict")
    return RunConfig.from_dict(apply_overrides(written, overrides or {}))
