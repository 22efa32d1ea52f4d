"""Fine-tuning learns a task the model cannot do at the start, on held-out prompts, full and LoRA.

    python scripts/sft_learning_check.py [--workdir DIR]

A small model (2 layers, width 64, a 300-token BPE trained on the data) is first trained to copy
a list of three distinct words from ten (`copy: fish door egg` → `fish door egg`), then
fine-tuned four ways on reversing them (`reverse: ...` → `egg door fish`) in the
prompt_completion format, by the training loop from prepared data: in full, with rank-8 LoRA, with
rank-8 LoRA and dropout 0.05 on the base frozen in int8, and in full with every instruction
reworded (`say these backwards: ...`). Accuracy is the exact match
of the greedy completion and its end-of-text on 120 lists no run trains on, read off one forward
pass: greedy decoding returns the reference iff each reference token is the argmax given the ones
before it. Prints one JSON line: the accuracies, and the completion tokens each fine-tuning's data
holds (the tokens a loss is taken on). Runs on whatever devices JAX has; one is quickest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import random
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.checkpoint import load_params
from jaxllm.config import RunConfig
from jaxllm.data.prepare import read_meta
from jaxllm.data.tokenizer import load_saved_tokenizer, prompt_ids
from jaxllm.model import Model
from jaxllm.train.loop import train

WORDS = "apple bird cloud door egg fish gold hat ice jam".split()
HELD_OUT = 120
BASE = ("copy", None, 200, 3e-3, {})  # task, instruction, steps, lr, model
FINE_TUNINGS = {
    "full": ("reverse", None, 200, 3e-3, {}),
    "lora": ("reverse", None, 200, 1e-2, dict(lora=dict(rank=8, alpha=16.0))),
    "lora-int8": ("reverse", None, 200, 1e-2, dict(lora=dict(rank=8, alpha=16.0, dropout=0.05), quantize="int8")),
    "reworded": ("reverse", "say these backwards", 200, 3e-3, {}),
}


def word_lists() -> tuple[list, list]:
    """(lists to train on, held-out lists): every ordered choice of three distinct words."""
    lists = list(itertools.permutations(WORDS, 3))
    random.Random(0).shuffle(lists)
    return lists[HELD_OUT:], lists[:HELD_OUT]


def example(task: str, words, instruction: str | None = None) -> dict:
    done = words if task == "copy" else words[::-1]
    return {"prompt": f"{instruction or task}: {' '.join(words)}\n", "completion": " ".join(done)}


def config(root: pathlib.Path, name: str, task, instruction, steps: int, lr: float, model: dict) -> RunConfig:
    inputs = root / f"{name}.jsonl"
    inputs.write_text("".join(json.dumps(example(task, w, instruction)) + "\n" for w in word_lists()[0]))
    base = name == "base"
    return RunConfig().updated(
        model=dict(num_layers=2, hidden=64, num_heads=8, num_kv_heads=4, mlp=128, vocab_size=300, max_seq_len=64,
                   qkv_share_every=1, dtype="float32", **model),
        parallel=dict(data=-1),
        data=dict(inputs=str(inputs), format="prompt_completion", dir=str(root / f"data-{name}"), val_fraction=0.05,
                  eval_every=10_000, tokenizer="bpe" if base else str(root / "base" / "tokenizer"),
                  bpe_vocab_size=300),
        train=dict(steps=steps, batch_size=32, seq_len=32, lr=lr, warmup_steps=10, weight_decay=0.0, log_every=50,
                   sample_tokens=0),
        checkpoint=dict(every_steps=steps),
        init=dict(hf=None if base else str(root / "base")),
    )  # fmt: skip


def accuracy(workdir: pathlib.Path, task: str, lists, instruction: str | None = None) -> float:
    """Exact-match accuracy of the greedy completions (and their end) of `lists`."""
    tokenizer = load_saved_tokenizer(workdir / "tokenizer")
    cfg, params, _ = load_params(workdir)
    rows, starts = [], []
    for words in lists:
        pair = example(task, words, instruction)
        prompt = prompt_ids(tokenizer, pair["prompt"])
        rows.append(prompt + tokenizer.encode(pair["completion"]) + [tokenizer.eos_id])
        starts.append(len(prompt))
    width = max(map(len, rows))
    tokens = np.array([r + [tokenizer.pad_id] * (width - len(r)) for r in rows], np.int32)
    guess = np.asarray(jnp.argmax(Model(cfg.model).logits(params, jnp.asarray(tokens[:, :-1])), -1))
    pairs = enumerate(zip(rows, starts, strict=True))
    right = [np.array_equal(guess[i, s - 1 : len(r) - 1], r[s:]) for i, (r, s) in pairs]
    return float(np.mean(right))


def learned_tokens(data_dir: pathlib.Path) -> int:
    """The tokens a loss is taken on in the prepared data, both splits (the masks' sum)."""
    meta, tokens = read_meta(data_dir / "tokens"), data_dir / "tokens"
    shards = [s["file"] for split in meta["splits"].values() for s in split["shards"]]
    return sum(int(np.fromfile(tokens / f.replace(".bin", ".mask"), np.uint8).sum()) for f in shards)


def trained(cfg: RunConfig, workdir: pathlib.Path) -> None:
    """Trains `cfg` to its last step; a run stopped early (SIGTERM saves and stops) ends the check."""
    train(cfg, workdir, progress=False)
    if (step := load_params(workdir)[2]) != cfg.train.steps:  # the checkpoint it saved as it stopped
        sys.exit(f"{workdir} stopped at step {step} of {cfg.train.steps}; its accuracy would mean nothing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="sft-check-"))
    root.mkdir(parents=True, exist_ok=True)
    held_out = word_lists()[1]
    trained(config(root, "base", *BASE), root / "base")
    tokenizer = load_saved_tokenizer(root / "base" / "tokenizer")
    completions = [example("reverse", w)["completion"] for w in word_lists()[0]]
    result = {
        "devices": jax.device_count(),
        # what a loss on completions alone learns from: each completion's tokens and its end-of-text
        "completion tokens": sum(len(ids) + 1 for ids in tokenizer.encode_batch(completions)),
        "base copies": accuracy(root / "base", "copy", held_out),
        "base reverses": accuracy(root / "base", "reverse", held_out),
    }
    for name, (task, instruction, *rest) in FINE_TUNINGS.items():
        trained(config(root, name, task, instruction, *rest), root / name)
        result[f"{name} reverses"] = accuracy(root / name, task, held_out, instruction)
        result[f"{name} learned tokens"] = learned_tokens(root / f"data-{name}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
