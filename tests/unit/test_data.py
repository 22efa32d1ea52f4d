"""Tokenizers, prepare, and the grain loader, on real text and real tokenizers."""

import json
import pathlib
import shutil
import sys
import unittest.mock

import jax
import numpy as np
import pytest
from support.runs import small_config, stdlib_glob

from jaxllm.config import ConfigError
from jaxllm.data.corpus import CorpusError
from jaxllm.data.dataset import prepare_data
from jaxllm.data.loader import TokenWindows, pack, train_batches
from jaxllm.data.prepare import prepare
from jaxllm.data.tokenizer import TokenizerError, get_tokenizer, load_saved_tokenizer, save_tokenizer
from jaxllm.data.tokenizer import main as tokenizer_cli
from jaxllm.model import Model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.step import init_params

SAMPLES = [
    "Hello world",
    "  leading spaces\tand\ttabs\n\n",
    "naïve café — 東京 🚀",
    "def f(x):\n    return x ** 2\n",
    "",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Text files, a JSONL file, and a file that is not valid UTF-8; no two windows alike."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (root / f"doc{i}.txt").write_text(" ".join(f"The fox {i} jumps over dog {j}." for j in range(4 * i + 8)))
    short = [f"record {i}: " + " ".join(f"item {i}.{j}" for j in range(i % 5 + 2)) for i in range(40)]
    (root / "more.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in short))
    (root / "latin1.txt").write_bytes(" ".join(f"caf\xe9 {j}" for j in range(40)).encode("latin-1"))
    return root


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    """The CLI's `train`, in this process; the latin-1 file must not crash it."""
    out = tmp_path_factory.mktemp("bpe")
    argv = ["jaxllm.data.tokenizer", "train", "--input", str(corpus / "*"), "--vocab-size", "300", "--out", str(out)]
    with unittest.mock.patch.object(sys, "argv", argv):
        tokenizer_cli()
    return get_tokenizer(out)


@pytest.fixture(scope="module")
def prepared(corpus, bpe, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "tokens"
    meta = prepare([str(corpus / "*")], bpe.name, out, val_fraction=0.3, workers=1, progress=False)
    return out, meta


# GPT-2 ids published by others: the test suites of transformers.js (tests/models/gpt2/
# test_tokenization_gpt2.js, "Xenova/gpt2") and of tiktoken (tests/test_encoding.py), and OpenAI's
# tokenizer-page example as encoded in the gpt-3-encoder test suites.
GPT2_PUBLISHED = {
    "   leading space": [220, 220, 3756, 2272],
    "trailing space   ": [9535, 4386, 2272, 220, 220, 220],
    "Hi  Hello": [17250, 220, 18435],
    "\t": [197],
    "You should've done this": [1639, 815, 1053, 1760, 428],
    "A\n'll !!to?'d''d of, can't.": [32, 198, 1183, 37867, 1462, 8348, 67, 7061, 67, 286, 11, 460, 470, 13],
    "0123456789 0 1 2 3 4 5 6 7 8 9 10 100 1000":
        [486, 1954, 2231, 3134, 4531, 657, 352, 362, 513, 604, 642, 718, 767, 807, 860, 838, 1802, 8576],
    "000000000": [10535, 830],
    "0000000000000000": [25645],
    "I bought an apple for $1.00 at the store.": [40, 5839, 281, 17180, 329, 720, 16, 13, 405, 379, 262, 3650, 13],
    "UNwant\u00e9d,running": [4944, 42949, 2634, 67, 11, 20270],
    "\u751f\u6d3b\u7684\u771f\u8c1b\u662f": [37955, 162, 112, 119, 21410, 40367, 253, 164, 108, 249, 42468],
    "test $1 R2 #3 \u20ac4 \u00a35 \u00a56 \u20a37 \u20b98 \u20b19 test": [
        9288, 720, 16, 371, 17, 1303, 18, 10432, 19, 4248, 20, 38221, 21, 2343, 224, 96, 22, 2343, 224, 117, 23,
        2343, 224, 109, 24, 1332,
    ],
    "hello \U0001f44b world \U0001f30d": [31373, 50169, 233, 995, 12520, 234, 235],
    "\u201cwrote jack a letter\u201d": [447, 250, 42910, 14509, 257, 3850, 447, 251],
    "Many words map to one token, but some don't: indivisible.\n\nUnicode characters like emojis may be split "
    "into many tokens containing the underlying bytes: \U0001f91a\U0001f3fe\n\nSequences of characters commonly "
    "found next to each other may be grouped together: 1234567890": [
        7085, 2456, 3975, 284, 530, 11241, 11, 475, 617, 836, 470, 25, 773, 452, 12843, 13, 198, 198, 3118, 291,
        1098, 3435, 588, 795, 13210, 271, 743, 307, 6626, 656, 867, 16326, 7268, 262, 10238, 9881, 25, 12520, 97,
        248, 8582, 237, 122, 198, 198, 44015, 3007, 286, 3435, 8811, 1043, 1306, 284, 1123, 584, 743, 307, 32824,
        1978, 25, 17031, 2231, 30924, 3829,
    ],
}  # fmt: skip


def test_gpt2_ids_match_published_ones_and_round_trip():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    for text, ids in GPT2_PUBLISHED.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text
    assert tok.vocab_size == 50257 and tok.eos_id == tok.bos_id == tok.pad_id == 50256
    for text in SAMPLES + ["<|endoftext|> is plain text inside a document"]:
        assert tok.decode(tok.encode(text)) == text


def test_trained_bpe_round_trips_and_has_explicit_specials(bpe):
    assert bpe.vocab_size == 300
    assert bpe.decode([bpe.eos_id]) == "<|endoftext|>" and bpe.decode([bpe.pad_id]) == "<|pad|>"
    for text in SAMPLES:
        assert bpe.decode(bpe.encode(text)) == text


def test_unknown_tokenizer_is_a_clear_error():
    with pytest.raises(TokenizerError, match="use 'gpt2' or a path to a tokenizer.json"):
        get_tokenizer("no/such/tokenizer")


def test_a_saved_tokenizer_reloads_and_another_is_refused(bpe, tmp_path):
    save_tokenizer(bpe, tmp_path / "run")
    (tmp_path / "elsewhere").mkdir()
    moved = pathlib.Path(shutil.copy(bpe.name, tmp_path / "elsewhere" / "tokenizer.json"))
    for override in (None, str(moved)):  # the saved copy, or the same file from elsewhere
        loaded = load_saved_tokenizer(tmp_path / "run", override)
        assert loaded.fingerprint == bpe.fingerprint and loaded.encode(SAMPLES[0]) == bpe.encode(SAMPLES[0])
    with pytest.raises(TokenizerError, match="is not the one in .* that the model was trained with"):
        load_saved_tokenizer(tmp_path / "run", "gpt2")
    save_tokenizer(get_tokenizer("gpt2"), tmp_path / "gpt2_run")
    assert load_saved_tokenizer(tmp_path / "gpt2_run").name == "gpt2"
    with pytest.raises(TokenizerError, match="holds no tokenizer; pass --tokenizer"):
        load_saved_tokenizer(tmp_path / "nothing_saved")


def test_prepare_counts_splits_and_is_idempotent(corpus, bpe, prepared):
    out, meta = prepared
    docs = {s: (out / f"{s}.docs").read_text().split() for s in ("train", "val")}
    assert docs["train"] and docs["val"] and not set(docs["train"]) & set(docs["val"])
    # Every document, counted independently: its tokens plus one end-of-text.
    from jaxllm.data.corpus import read_documents, resolve_inputs

    expected = {
        key: len(bpe.encode(text)) + 1 for f in resolve_inputs([str(corpus / "*")]) for key, text in read_documents(f)
    }
    assert sorted(docs["train"] + docs["val"]) == sorted(expected)
    for split in ("train", "val"):
        assert meta["splits"][split]["tokens"] == sum(expected[k] for k in docs[split])
        stream = np.fromfile(out / meta["splits"][split]["shards"][0]["file"], dtype=meta["dtype"])
        assert (stream == bpe.eos_id).sum() == len(docs[split])
    assert meta["tokenizer"]["fingerprint"] == bpe.fingerprint
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare([str(corpus / "*")], bpe.name, out, val_fraction=0.3, progress=False) == meta
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_the_split_is_the_same_wherever_the_corpus_lies(corpus, bpe, prepared, tmp_path):
    """The same files under another directory (another mount, another workdir) give the same
    documents to each split, and the same tokens."""
    out, meta = prepared
    moved = shutil.copytree(corpus, tmp_path / "elsewhere" / "corpus")
    again = prepare([str(moved / "*")], bpe.name, tmp_path / "out", val_fraction=0.3, workers=1, progress=False)
    for split in ("train", "val"):
        keys = [(tmp_path / "out" / f"{split}.docs").read_text().split(), (out / f"{split}.docs").read_text().split()]
        assert [k.replace(str(moved), "") for k in keys[0]] == [k.replace(str(corpus), "") for k in keys[1]]
        assert again["splits"][split]["tokens"] == meta["splits"][split]["tokens"]


def test_loader_is_deterministic_and_resumes_bit_identically(prepared, bpe):
    out, _ = prepared

    def first(it, n):
        return [next(it) for _ in range(n)]

    a, b = (first(train_batches(out, 16, 4, seed=7, eos_id=bpe.eos_id), 6) for _ in range(2))
    other = first(train_batches(out, 16, 4, seed=8, eos_id=bpe.eos_id), 6)
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, other, strict=True))

    it = train_batches(out, 16, 4, seed=7, eos_id=bpe.eos_id)
    first(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # small and serialisable
    resumed = train_batches(out, 16, 4, seed=7, eos_id=bpe.eos_id)
    resumed.set_state(state)
    for x, y in zip(first(resumed, 3), a[3:], strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in x)


def test_processes_read_disjoint_slices_that_cover_an_epoch(prepared, bpe):
    out, _ = prepared
    windows = TokenWindows(out, "train", 16)
    per_process = len(windows) // 2
    seen = []
    for p in range(2):
        it = train_batches(out, 16, 1, seed=3, eos_id=bpe.eos_id, process_index=p, process_count=2)
        seen.append({tuple(np.append(next(it)["inputs"][0], -1)) for _ in range(per_process)})
    everything = {tuple(np.append(windows[i][:-1], -1)) for i in range(len(windows))}
    assert len(everything) == len(windows), "the corpus should have no two windows alike"
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] <= everything
    assert len(seen[0] | seen[1]) == 2 * per_process >= len(windows) - 1  # an odd window out at most


def test_packing_marks_documents():
    eos = 9
    window = np.array([5, 6, eos, 7, 8, 8, eos, 1, 2])
    example = pack(window, eos)
    np.testing.assert_array_equal(example["segment_ids"], [1, 1, 1, 2, 2, 2, 2, 3])
    np.testing.assert_array_equal(example["positions"], [0, 1, 2, 0, 1, 2, 3, 0])
    np.testing.assert_array_equal(example["loss_mask"], [1, 1, 0, 1, 1, 1, 0, 1])  # no target across documents


def test_packed_batches_never_attend_across_documents(prepared, bpe):
    """Logits of every document in a packed window equal the logits of that document run alone."""
    out, _ = prepared
    cfg = small_config(vocab_size=bpe.vocab_size)
    windows = TokenWindows(out, "train", 64)
    example = next(
        e for e in map(lambda i: pack(windows[i], bpe.eos_id), range(len(windows))) if e["segment_ids"][-1] > 2
    )
    tokens, segments, positions = (example[k][None] for k in ("inputs", "segment_ids", "positions"))
    params = init_params(cfg)
    with jax.set_mesh(make_mesh(cfg.parallel, jax.devices()[:1])):
        run = jax.jit(lambda p, t, s, q: Model(cfg.model).logits(p, t, s, q))
        packed = run(params, tokens, segments, positions)
        for seg in set(segments[0]):
            where = np.flatnonzero(segments[0] == seg)
            alone = run(params, tokens[:, where], None, None)
            np.testing.assert_allclose(packed[0, where], alone[0], rtol=1e-4, atol=1e-4)


def test_bad_inputs_are_refused_before_training(tmp_path, corpus, prepared):
    with pytest.raises(CorpusError, match="matches no files"):
        prepare([str(tmp_path / "missing/*.txt")], "gpt2", tmp_path / "out", progress=False)
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(CorpusError, match="contain no text documents"):
        prepare([str(tmp_path / "empty.txt")], "gpt2", tmp_path / "out", progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: needs a string field 'text'"):
        prepare([str(tmp_path / "bad.jsonl")], "gpt2", tmp_path / "out", progress=False)

    cfg = small_config()
    cfg = cfg.updated(data=dict(inputs=str(corpus / "*"), tokenizer="gpt2", dir=str(tmp_path / "run")))
    with pytest.raises(ConfigError, match=r"model.vocab_size=257 is smaller than the tokenizer's 50257 tokens"):
        prepare_data(cfg.data, cfg.model)

    out, _ = prepared  # made with the trained BPE; the config names gpt2
    cfg = cfg.updated(model=dict(vocab_size=50257), data=dict(dir=str(out.parent)))
    with pytest.raises(ConfigError, match="was prepared with tokenizer .* but the config names 'gpt2'"):
        prepare_data(cfg.data, cfg.model)


def test_stdlib_corpus_leaves_out_installed_packages_and_tests():
    from jaxllm.data.corpus import resolve_inputs

    files = resolve_inputs(["stdlib"])
    assert any(f.name == "topics.py" and f.parent.name == "pydoc_data" for f in files)  # the documentation
    assert not any({"site-packages", "test", "tests"} & set(f.parts) for f in files)
    assert set(resolve_inputs([stdlib_glob("json")])) <= set(files)
