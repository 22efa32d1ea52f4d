"""The train command end to end: it trains, logs, samples, is served and exported, and the
same on every layout."""

import re
import shlex
import sys

import numpy as np
import pytest
from support.docs import runnable_block
from support.runs import cli_data_flags, metrics, run, train_command

from jaxllm.data.tokenizer import load_saved_tokenizer
from jaxllm.export import export

pytestmark = pytest.mark.minutes(6)  # about 6 min on 2 cores: scheduled first (tests/conftest.py)

LONGER = ["--config.train.steps=40", "--config.train.seq_len=64", "--config.train.log_every=10",
          "--config.data.eval_every=20", "--config.train.sample_tokens=16"]  # fmt: skip


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run") / "tensor2"
    return run(train_command(workdir, *LONGER, "--config.parallel.tensor=2")).stdout, metrics(workdir), workdir


def test_cli_trains_logs_and_samples(cli_run):
    out, logged, workdir = cli_run
    assert "mesh: data 4 × fsdp 1 × stage 1 × tensor 2 = 8 cpu devices" in out
    assert '"num_layers": 4' in out  # the resolved config, with overrides applied
    assert "sample:" in out
    assert [m["step"] for m in logged] == [10, 20, 30, 40]
    for m in logged:
        assert {"step", "loss", "tokens_per_s", "mfu", "grad_norm", "lr"} <= m.keys()
        assert m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.3, "loss should clearly fall"
    val = [m["val_loss"] for m in logged if "val_loss" in m]
    assert [m["step"] for m in logged if "val_loss" in m] == [20, 40]
    assert val[1] < val[0], "validation loss should fall"
    assert "data: training a 512-token byte-level BPE" in out and "data: prepared" in out
    shown = re.findall(r"loss=[^\]\r\n]*", out)  # the progress bar's figures, each time it was drawn
    assert shown and not any("nan" in line for line in shown), shown
    assert any("val=" in line for line in shown), "the bar should show the validation loss once there is one"
    events = list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_cli_run_is_served_with_its_own_tokenizer(cli_run, tmp_path):
    """The run saved its tokenizer; serving and an export use it, and refuse another one."""
    workdir = cli_run[2]
    serve = [sys.executable, "-m", "jaxllm.serve", "--prompt", "def ", "--prompt", "import", "--max-tokens", "8",
             "--config.serve.max_len=64", "--config.serve.slots=2"]  # fmt: skip
    out = run([*serve, "--workdir", str(workdir), "--config.serve.tensor=2"]).stdout
    assert "tensor parallel over 2" in out
    assert re.search(r"--- 'def ' \((length|stop), \d+ tokens\)\ndef ", out), out
    assert "--- 'import' (" in out
    export(workdir, tmp_path / "export")
    assert load_saved_tokenizer(tmp_path / "export" / "tokenizer").fingerprint == (
        load_saved_tokenizer(workdir / "tokenizer").fingerprint
    )
    refused = run([*serve, "--checkpoint", str(tmp_path / "export"), "--tokenizer", "gpt2"], check=False)
    assert refused.returncode == 1 and "that the model was trained with" in refused.stderr, refused.stderr


def test_docs_bring_a_llama_commands_run_as_written(cli_run, tmp_path):
    """The Hugging Face page's try-it commands on this run: to-hf with the shared QKV expanded,
    serve --hf, from-hf, and a fine-tune that starts from the run's trained weights."""
    block = runnable_block("docs/huggingface.md", "llama-commands")
    paths = {"runs/tiny": cli_run[2], "exports/llama-tiny": tmp_path / "export", "llama-tiny": tmp_path / "llama",
             "runs/llama-tiny-ft": tmp_path / "ft"}  # fmt: skip

    def here(word: str) -> str:
        flag, _, value = word.rpartition("=")
        return f"{flag}={paths[value]}" if flag and value in paths else str(paths.get(word, word))

    out = []
    for line in block.strip().splitlines():
        command = [sys.executable, *map(here, shlex.split(line)[1:])]
        if "jaxllm.train" in command:  # this run's shapes and data, a few steps
            command += [*cli_data_flags(tmp_path / "data"), "--config.train.seq_len=64", "--config.train.steps=2",
                        "--config.train.log_every=1", "--config.train.sample_tokens=4"]  # fmt: skip
        out.append(run(command).stdout)
    assert "an exact Llama with" in out[0] and "--- 'def read_config(path):' (" in out[1] and "its tokenizer" in out[2]
    assert f"init: params from {tmp_path / 'llama'}" in out[3]
    first = metrics(tmp_path / "ft")[0]
    assert first["step"] == 1 and first["loss"] < cli_run[1][-1]["loss"] + 0.3  # the trained weights, not a fresh init


def test_docs_serving_snippet_runs_as_written(cli_run, capsys):
    snippet = runnable_block("docs/serving.md", "serve-snippet")
    exec(compile(snippet.replace('"runs/tiny"', repr(str(cli_run[2]))), "docs/serving.md (engine)", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    assert len(lines) == 2 and all(line.split()[0] in ("stop", "length") for line in lines), lines


def test_docs_offline_prompts_run_as_written(cli_run):
    """The serving page's `--prompt` command on this run."""
    line = runnable_block("docs/serving.md", "offline-prompts").strip()
    out = run([sys.executable, *shlex.split(line.replace("runs/tiny", str(cli_run[2])))[1:]]).stdout
    assert re.search(r"--- 'def read_config\(path\):' \((length|stop), \d+ tokens\)\n", out), out
    assert "--- 'import ' (" in out


def test_cli_is_deterministic_across_layouts(cli_run):
    """Same seed and data, another layout (fsdp instead of tensor): the same losses within fp32 tolerance."""
    workdir = cli_run[2].parent / "fsdp4"
    run(train_command(workdir, *LONGER, "--config.parallel.data=2", "--config.parallel.fsdp=4"))
    np.testing.assert_allclose([m["loss"] for m in metrics(workdir)], [m["loss"] for m in cli_run[1]], rtol=1e-4)


def test_cli_reports_config_errors_clearly(tmp_path):
    proc = run(train_command(tmp_path / "bad", "--config.parallel.data=3"), check=False)
    assert proc.returncode != 0
    assert "error: parallel.data=3" in proc.stderr and "but 8 exist" in proc.stderr
    proc = run(train_command(tmp_path / "gpu_only", "--config.model.attention=cudnn"), check=False)
    assert proc.returncode != 0
    assert "error: model.attention='cudnn' is a GPU kernel" in proc.stderr and "'cpu'" in proc.stderr


def test_pipeline_training_losses_match_no_pipeline(tmp_path):
    """The CLI's metrics.jsonl losses with a pipeline equal those without it."""
    layouts = {
        "plain": ["--config.parallel.data=8"],
        "pipeline": ["--config.parallel.data=2", "--config.parallel.stage=4", "--config.parallel.microbatches=4"],
    }
    runs = {}
    for name, layout in layouts.items():
        shape = ["--config.model.num_layers=8", "--config.model.qkv_share_every=2", "--config.train.log_every=4",
                 "--config.data.eval_every=4"]  # fmt: skip
        run(train_command(tmp_path / name, *shape, *layout))
        runs[name] = metrics(tmp_path / name)
    assert [m["step"] for m in runs["pipeline"]] == [4, 8, 12]
    np.testing.assert_allclose([m["loss"] for m in runs["pipeline"]], [m["loss"] for m in runs["plain"]], rtol=1e-5)
    assert all(m["bubble"] == pytest.approx(3 / 7) for m in runs["pipeline"])


