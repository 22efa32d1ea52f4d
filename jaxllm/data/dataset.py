"""A run's data, made ready before the first step: the tokenizer (trained on the corpus if the
config asks for one), the prepared token shards, and every check that would otherwise fail later."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxllm import logs
from jaxllm.config import ConfigError, DataConfig, ModelConfig
from jaxllm.data.corpus import read_records, read_texts, resolve_inputs, work_units
from jaxllm.data.examples import FIELDS, OPTIONAL
from jaxllm.data.prepare import prepare, read_meta
from jaxllm.data.tokenizer import Tokenizer, get_tokenizer, train_bpe
from jaxllm.errors import JaxllmError

log = logs.get(__name__)


@dataclasses.dataclass(frozen=True)
class Data:
    tokenizer: Tokenizer
    tokens_dir: pathlib.Path


def _inputs(data: DataConfig) -> list[str]:
    patterns = [p.strip() for p in data.inputs.split(",") if p.strip()]
    if not patterns:
        raise ConfigError(f"data.inputs is empty: name the {data.format} data to train on, e.g. "
                          "--config.data.inputs='train.jsonl' (globs, comma-separated)")  # fmt: skip
    return patterns


def _texts(data: DataConfig):
    """The text a BPE is trained on: documents, or the messages', prompts' and completions' text."""
    units = [unit for f in resolve_inputs(_inputs(data)) for unit in work_units(f)]
    for unit in units:
        if data.format == "text":
            yield from (text for _, text in read_texts(unit, data.text_field))
            continue
        for _, record in read_records(unit, FIELDS[data.format], OPTIONAL[data.format]):
            parts = record.get("messages") if data.format == "chat" else [record]
            fields = ("content",) if data.format == "chat" else ("prompt", "completion")
            if isinstance(parts, list):  # malformed records are named when they are prepared
                yield from (p[k] for p in parts if isinstance(p, dict) for k in fields if isinstance(p.get(k), str))


def _tokenizer_spec(data: DataConfig, directory: pathlib.Path) -> str:
    """The tokenizer named by `data.tokenizer`; 'bpe' trains one on the inputs the first time."""
    if data.tokenizer != "bpe":
        return data.tokenizer
    path = directory / "tokenizer" / "tokenizer.json"
    if not path.exists():
        files = resolve_inputs(_inputs(data))
        log.info(f"data: training a {data.bpe_vocab_size}-token byte-level BPE on {len(files)} inputs (first run only)")
        train_bpe(_texts(data), data.bpe_vocab_size, path.parent)
    return str(path)


def _check(tokenizer: Tokenizer, tokens_dir: pathlib.Path, model: ModelConfig) -> None:
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} tokens "
            f"({tokenizer.name}); set model.vocab_size >= {tokenizer.vocab_size}"
        )
    meta = read_meta(tokens_dir)
    if meta is not None and meta["tokenizer"]["fingerprint"] != tokenizer.fingerprint:
        raise ConfigError(
            f"data.dir: {tokens_dir} was prepared with tokenizer {meta['tokenizer']['name']!r}, but the config names "
            f"{tokenizer.name!r} (another vocabulary); set data.dir to a new directory or delete {tokens_dir}"
        )


def prepare_data(data: DataConfig, model: ModelConfig) -> Data:
    """Runs once per run, before any step. Process 0 trains the tokenizer and prepares the shards;
    the other processes wait for it, then check the same things (the vocabulary fits `model`)."""
    directory = pathlib.Path(data.dir)
    failure = None
    if jax.process_index() == 0:
        try:
            spec = _tokenizer_spec(data, directory)
            _check(get_tokenizer(spec), directory / "tokens", model)
            prepare(_inputs(data), spec, directory / "tokens", data.val_fraction, data_format=data.format,
                    text_field=data.text_field, template=data.chat_template)  # fmt: skip
        except JaxllmError as e:
            failure = e
    if jax.process_count() > 1:  # the others must not wait for data that will never come
        if multihost_utils.broadcast_one_to_all(np.asarray(failure is not None)) and failure is None:
            raise ConfigError("process 0 could not prepare the data; its output says why")
    if failure is not None:
        raise failure
    tokenizer = get_tokenizer(_tokenizer_spec(data, directory))
    _check(tokenizer, directory / "tokens", model)
    return Data(tokenizer, directory / "tokens")
