"""Fine-tuning data: chat and prompt/completion records → token shards with a loss mask, packed
whole into windows; Parquet and saved Hugging Face datasets read as JSONL is. Every mask is
checked against one computed another way (pieces tokenized apart, decoded text, transformers)."""

import json
import pathlib

import chex
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from support.hf import hf_extra
from support.runs import small_config

from jaxllm.data.chat import ChatTemplate, ChatTemplateError, special_tokens
from jaxllm.data.corpus import CorpusError, read_records
from jaxllm.data.examples import FIELDS, check_chat, encode_chat
from jaxllm.data.loader import DataError, ExampleWindows, eval_batches, train_batches
from jaxllm.data.prepare import prepare, read_meta
from jaxllm.data.tokenizer import EOS, get_tokenizer, train_bpe
from jaxllm.model import Model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.step import init_params, loss_sums

CHATS = [
    {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}." + " Really." * (i % 4)},
        {"role": "user", "content": "Sure? Café 東京"},
        {"role": "assistant", "content": "Yes, quite sure" + " and certain" * (i % 3) + "."},
    ]}
    for i in range(12)
] + [
    {"tools": [{"name": "add", "parameters": {"a": "int"}}], "messages": [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "Calling add."},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "The sum is 5."},
    ]},
]  # fmt: skip
PAIRS = [
    {"prompt": f"Question {i}: what is {i} times three?", "completion": f" It is {3 * i}." + " Indeed" * (i % 6)}
    for i in range(40)
]
LLAMA3 = (  # Llama 3's shape: special tokens around every turn, assistant text in {% generation %} tags
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _texts():
    yield from (m["content"] for c in CHATS for m in c["messages"])
    yield from (r[k] for r in PAIRS for k in ("prompt", "completion"))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return get_tokenizer(train_bpe(_texts(), 300, tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="module")
def llama3(bpe, tmp_path_factory):
    """The BPE with Llama 3's chat tokens and template, as a model directory ships them."""
    directory = tmp_path_factory.mktemp("llama3")
    tok = tokenizers.Tokenizer.from_file(bpe.name)
    tok.add_special_tokens(LLAMA3_SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3,
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _write_jsonl(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def _runs(mask: np.ndarray) -> list[slice]:
    """The maximal runs of 1s."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [slice(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True)]


@pytest.mark.parametrize("name", ["bpe", "gpt2"])
def test_default_template_masks_exactly_the_assistant_turns_and_their_end(bpe, name):
    """Decoded, the masked runs are each assistant turn's text and its end-of-text, nothing else."""
    tokenizer = bpe if name == "bpe" else get_tokenizer("gpt2")
    template = ChatTemplate(tokens=special_tokens(tokenizer))
    for record in CHATS:
        ids, mask = encode_chat(tokenizer, template, "x", record)
        assert ids.count(tokenizer.eos_id) == sum(m["role"] == "assistant" for m in record["messages"])
        turns = [f" {m['content']}{EOS}" for m in record["messages"] if m["role"] == "assistant"]
        assert [tokenizer.decode(ids[run]) for run in _runs(mask)] == turns
        assert tokenizer.decode(ids) == template.render(record["messages"], add_generation_prompt=False)


def test_a_models_own_template_masks_what_tokenizing_the_turns_apart_gives(llama3):
    """Special tokens in the rendering are parsed as tokens; the mask is 1 on each assistant
    content and its <|eot_id|>: the reference tokenizes every piece on its own."""
    tokenizer = get_tokenizer(llama3)
    special = {t: tokenizer.encode_special(t)[0] for t in LLAMA3_SPECIALS}
    assert len(set(special.values())) == 4 and tokenizer.eos_id == special["<|eot_id|>"]
    template = ChatTemplate.chosen(None, tokenizer.chat_template, special_tokens(tokenizer))
    for record in CHATS:
        want_ids, want_mask = [special["<|begin_of_text|>"]], [0]
        for m in record["messages"]:
            head = [special["<|start_header_id|>"], *tokenizer.encode(m["role"]), special["<|end_header_id|>"]]
            body = [*tokenizer.encode(m["content"]), special["<|eot_id|>"]]
            want_ids += head + tokenizer.encode("\n\n") + body
            want_mask += [0] * (len(head) + 2) + [int(m["role"] == "assistant")] * len(body)
        ids, mask = encode_chat(tokenizer, template, "x", record)
        assert ids == want_ids and mask.tolist() == want_mask
        # the prompt for the first reply, as serving tokenizes it: the same ids up to the reply's text
        first = next(i for i, m in enumerate(record["messages"]) if m["role"] == "assistant")
        prompt = tokenizer.encode_special(template.render(record["messages"][:first]))
        reply = [i for i, t in enumerate(want_ids) if t == special["<|end_header_id|>"]][first] + 1  # its header
        assert prompt[:reply] == want_ids[:reply] and tokenizer.decode(prompt[reply:]) == "\n\n"


def test_a_template_that_does_not_only_append_is_refused(bpe):
    forgetful = "{% for m in messages[-1:] %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    template = ChatTemplate(forgetful, special_tokens(bpe))
    with pytest.raises(ChatTemplateError, match="does not render conversations incrementally"):
        template.assistant_spans(CHATS[0]["messages"])
    with pytest.raises(CorpusError, match="^x: .*does not render conversations incrementally"):
        encode_chat(bpe, template, "x", CHATS[0])


def test_a_model_without_a_template_gets_the_default_transcript():
    """What serving and the chat data format choose for a tokenizer with no template of its own."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    chosen = ChatTemplate.chosen(None, None, {"eos_token": EOS})
    served = chosen.render(messages + [{"role": "user", "content": "Bye"}])
    assert served == f"user: Hi\nassistant: Hello{EOS}user: Bye\nassistant:"


def test_malformed_records_name_the_file_line_and_field(tmp_path, bpe):
    bad = {
        '{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}':
            r"chat.jsonl:2: messages\[1\].role must be one of system, user, assistant, tool",
        '{"messages": [{"role": "user", "content": 3}]}': r"chat.jsonl:2: messages\[0\].content must be a string",
        '{"messages": [{"role": "user", "content": "a"}]}': "chat.jsonl:2: messages has no assistant message",
        '{"message": []}': "chat.jsonl:2: messages must be a non-empty list",
        '{"messages": [}': r"chat.jsonl:2: not valid JSON",
    }  # fmt: skip
    for line, error in bad.items():
        path = tmp_path / "chat.jsonl"
        path.write_text(json.dumps(CHATS[0]) + "\n" + line + "\n")
        with pytest.raises(CorpusError, match=error):
            for key, record in read_records((path, None), FIELDS["chat"]):
                check_chat(key, record)
    path = _write_jsonl(tmp_path / "pairs.jsonl", [PAIRS[0], {"prompt": "a"}])
    with pytest.raises(CorpusError, match="pairs.jsonl:2: completion must be a string"):  # raised in a worker
        prepare([str(path)], bpe.name, tmp_path / "out", 0.0, 1, False, data_format="prompt_completion")
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}))
    with pytest.raises(CorpusError, match=r"pairs.jsonl:1: messages\[1\].role must be one of"):
        prepare([str(path)], bpe.name, tmp_path / "out", 0.0, workers=1, progress=False, data_format="chat")


@pytest.fixture(scope="module")
def pairs(bpe, tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    _write_jsonl(root / "pairs.jsonl", PAIRS)
    prepare([str(root / "pairs.jsonl")], bpe.name, root / "out", 0.25, workers=1, progress=False,
            data_format="prompt_completion")  # fmt: skip
    return root / "out"


def _expected_windows(bpe, keys: list[str], length: int):
    """Reference packing: each example's ids and mask from the tokenizer, greedily packed."""
    windows, current = [], []
    for key in keys:
        record = PAIRS[int(key.rsplit(":", 1)[1]) - 1]
        prompt, completion = bpe.encode(record["prompt"]), bpe.encode(record["completion"]) + [bpe.eos_id]
        ids, mask = (prompt + completion)[:length], ([0] * len(prompt) + [1] * len(completion))[:length]
        if sum(len(i) for i, _, _ in current) + len(ids) > length:
            windows.append(current)
            current = []
        current.append((ids, mask, record))
    return windows + [current]


def test_prompt_completion_examples_pack_whole_with_their_masks(pairs, bpe, capsys):
    keys = (pairs / "train.docs").read_text().split()
    records = [PAIRS[int(k.rsplit(":", 1)[1]) - 1] for k in keys]
    lengths = [len(bpe.encode(r["prompt"])) + len(bpe.encode(r["completion"])) + 1 for r in records]
    length = sorted(lengths)[len(lengths) // 2]  # windows of seq_len + 1 tokens that some examples overflow
    seq_len, over = length - 1, sum(n > length for n in lengths)
    assert 0 < over < len(keys)
    expected = _expected_windows(bpe, keys, length)
    windows = ExampleWindows(pairs, "train", seq_len)
    printed = capsys.readouterr().out
    assert f"data: {over} of {len(keys)} train examples are longer than {length} tokens; truncated" in printed
    assert len(windows) == len(expected)
    for got, want in zip((windows[i] for i in range(len(windows))), expected, strict=True):
        tokens = np.full(length, bpe.pad_id)
        segments, learn, at = np.full(length, len(want) + 1), np.zeros(length), 0
        for j, (ids, mask, _) in enumerate(want):
            tokens[at : at + len(ids)], learn[at : at + len(ids)], segments[at : at + len(ids)] = ids, mask, j + 1
            at += len(ids)
        np.testing.assert_array_equal(got["inputs"], tokens[:-1])
        np.testing.assert_array_equal(got["targets"], tokens[1:])
        np.testing.assert_array_equal(got["segment_ids"], segments[:-1])
        np.testing.assert_array_equal(got["loss_mask"], (segments[:-1] == segments[1:]) * learn[1:])
        for j, (ids, _, record) in enumerate(want):  # positions restart; the learned text is the completion
            where = np.flatnonzero(got["segment_ids"] == j + 1)
            np.testing.assert_array_equal(got["positions"][where], np.arange(len(where)))
            learned = bpe.decode(got["targets"][where][got["loss_mask"][where] > 0])
            full = record["completion"] + EOS
            assert learned == full if len(ids) < length else full.startswith(learned) and learned
    with pytest.raises(DataError, match=f"{over} of {len(keys)} train examples are longer than {length} tokens"):
        ExampleWindows(pairs, "train", seq_len, "error")
    batch = next(train_batches(pairs, seq_len, 4, seed=1, eos_id=bpe.eos_id, overlong="truncate"))
    assert batch["inputs"].shape == (4, seq_len) and batch["loss_mask"].sum() > 0
    val = eval_batches(pairs, 64, 2, 1, bpe.eos_id, "error")[0]  # nothing is longer than 65 tokens
    assert set(val["segment_ids"][0]) >= {1, 2}


def _tables(root: pathlib.Path, records: list[dict]) -> None:
    """The records as JSONL, as Parquet with row groups of 4, and as a dataset saved by
    datasets' save_to_disk (Arrow stream files listed by state.json)."""
    _write_jsonl(root / "a.jsonl", records)
    table = pa.Table.from_pylist(records)
    pq.write_table(table, root / "b.parquet", row_group_size=4)
    assert pq.ParquetFile(root / "b.parquet").num_row_groups >= 2
    dataset = root / "c_dataset"
    dataset.mkdir()
    halves = [table.slice(0, len(records) // 2), table.slice(len(records) // 2)]
    for i, half in enumerate(halves):
        with pa.OSFile(str(dataset / f"data-{i:05d}-of-00002.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(half, max_chunksize=3)
    state = {"_data_files": [{"filename": f"data-{i:05d}-of-00002.arrow"} for i in range(2)], "_fingerprint": "0",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}  # fmt: skip
    (dataset / "state.json").write_text(json.dumps(state))
    (dataset / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))


def _thirds(out: pathlib.Path, suffix: str, dtype) -> list[np.ndarray]:
    meta = read_meta(out)
    (shard,) = meta["splits"]["train"]["shards"]
    lens = np.fromfile(out / "train-00000.lens", np.int32)
    data = np.fromfile(out / shard["file"].replace(".bin", suffix), dtype)
    n = len(lens) // 3
    bounds = np.cumsum([0, lens[:n].sum(), lens[n : 2 * n].sum(), lens[2 * n :].sum()])
    if suffix == ".lens":
        return [lens[:n], lens[n : 2 * n], lens[2 * n :]]
    return [data[bounds[i] : bounds[i + 1]] for i in range(3)]


@pytest.fixture(scope="module")
def chat_tables(bpe, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tables")
    _tables(root, CHATS)
    prepare([str(root / "a.jsonl"), str(root / "b.*"), str(root / "c_*")], bpe.name, root / "out", 0.0, workers=1,
            progress=False, data_format="chat")  # fmt: skip
    return root / "out"


def test_parquet_and_a_saved_dataset_prepare_as_jsonl_does(chat_tables, bpe, tmp_path):
    """The same records, as JSONL, Parquet (two row groups and more) and a saved dataset, give the
    same tokens, lengths and masks: for chats, and for text in a named field."""
    meta = read_meta(chat_tables)
    assert meta["format"] == "chat" and meta["splits"]["train"]["documents"] == 3 * len(CHATS)
    for suffix, dtype in ((".bin", meta["dtype"]), (".lens", np.int32), (".mask", np.uint8)):
        jsonl, parquet, dataset = _thirds(chat_tables, suffix, dtype)
        np.testing.assert_array_equal(jsonl, parquet)
        np.testing.assert_array_equal(jsonl, dataset)
    template = ChatTemplate(tokens=special_tokens(bpe))
    ids, mask = encode_chat(bpe, template, "x", CHATS[0])
    np.testing.assert_array_equal(_thirds(chat_tables, ".bin", meta["dtype"])[0][: len(ids)], ids)
    np.testing.assert_array_equal(_thirds(chat_tables, ".mask", np.uint8)[0][: len(ids)], mask)

    texts = [{"body": f"document {i}: " + "words " * i, "other": i} for i in range(10)]
    _tables(tmp_path, texts)
    prepare([str(tmp_path / "*")], bpe.name, tmp_path / "out", 0.0, workers=1, progress=False, text_field="body")
    jsonl, parquet, dataset = _thirds(tmp_path / "out", ".bin", read_meta(tmp_path / "out")["dtype"])
    assert jsonl.tolist() == [t for r in texts for t in bpe.encode(r["body"]) + [bpe.eos_id]]
    np.testing.assert_array_equal(jsonl, parquet)
    np.testing.assert_array_equal(jsonl, dataset)
    assert not (tmp_path / "out" / "train-00000.mask").exists()
    with pytest.raises(Exception, match="no column 'text'"):
        prepare([str(tmp_path / "b.parquet")], bpe.name, tmp_path / "out2", 0.0, workers=1, progress=False)


def test_the_loss_and_its_gradient_ignore_every_masked_target(chat_tables, bpe):
    """A chat batch from the loader, a tiny model, and the training loss: changing the targets
    where the mask is 0 (prompts, padding, document ends) leaves the loss and every parameter's
    gradient bit-identical; changing one where it is 1 changes them."""
    windows = ExampleWindows(chat_tables, "train", 64)
    batch = {k: np.stack([windows[i][k] for i in range(4)]) for k in windows[0]}
    mask = batch["loss_mask"]
    assert 0 < mask.sum() < mask.size
    cfg = small_config(vocab_size=320, num_layers=2)
    params, model = init_params(cfg), Model(cfg.model)
    with jax.set_mesh(make_mesh(cfg.parallel, jax.devices()[:1])):
        loss_and_grad = jax.jit(jax.value_and_grad(lambda p, b: loss_sums(p, b, model)[0]))
        want = loss_and_grad(params, batch)
        masked = {**batch, "targets": np.where(mask == 0, (batch["targets"] + 7) % 256, batch["targets"])}
        assert (masked["targets"] != batch["targets"]).sum() == (mask == 0).sum()
        chex.assert_trees_all_equal(loss_and_grad(params, masked), want)
        one = tuple(np.argwhere(mask == 1)[0])
        unmasked = {**batch, "targets": batch["targets"].copy()}
        unmasked["targets"][one] = (unmasked["targets"][one] + 7) % 256
        assert loss_and_grad(params, unmasked)[0] != want[0]


try:
    import datasets
    import transformers
except ImportError:
    datasets = transformers = None


needs_hf = hf_extra("transformers", "datasets")


@needs_hf
def test_the_chat_mask_is_transformers_assistant_mask(llama3):
    """Token for token, transformers' own tokenization of the chat and the mask it derives from
    the template's {% generation %} tags."""
    ours = get_tokenizer(llama3)
    template = ChatTemplate.chosen(None, ours.chat_template, special_tokens(ours))
    theirs = transformers.AutoTokenizer.from_pretrained(llama3)
    for record in CHATS:
        ids, mask = encode_chat(ours, template, "x", record)
        out = theirs.apply_chat_template(
            record["messages"], tools=record.get("tools"), tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        assert ids == list(out["input_ids"])
        assert mask.tolist() == list(out["assistant_masks"])


@needs_hf
def test_a_dataset_saved_by_datasets_prepares_as_jsonl_does(bpe, tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", CHATS)
    datasets.Dataset.from_list(CHATS).save_to_disk(str(tmp_path / "b_saved"))
    prepare([str(tmp_path / "*")], bpe.name, tmp_path / "out", 0.0, 1, False, data_format="chat")
    lens = np.fromfile(tmp_path / "out" / "train-00000.lens", np.int32)
    assert len(lens) == 2 * len(CHATS)
    np.testing.assert_array_equal(lens[: len(CHATS)], lens[len(CHATS) :])
    for suffix, dtype in ((".bin", read_meta(tmp_path / "out")["dtype"]), (".mask", np.uint8)):
        data = np.fromfile(tmp_path / "out" / f"train-00000{suffix}", dtype)
        half = int(lens[: len(CHATS)].sum())
        np.testing.assert_array_equal(data[:half], data[half:])


def test_a_config_that_names_no_inputs_stops_before_any_work(tmp_path):
    """configs/llama_sft.py leaves data.inputs to the user: a run without them says so."""
    from jaxllm.config import ConfigError, load_config
    from jaxllm.data.dataset import prepare_data

    cfg = load_config("configs/llama_sft.py", {"data.dir": str(tmp_path / "data")})
    assert cfg.data.inputs == "" and cfg.data.format == "chat"
    with pytest.raises(ConfigError, match=r"data.inputs is empty: name the chat data to train on"):
        prepare_data(cfg.data, cfg.model)
    assert not (tmp_path / "data").exists()
