"""One command-line style: every entry point's `--help` lists the typed config fields it takes,
with type, default and description; `--config.x.y=v` is parsed by the field's type and refused,
naming the field, when it cannot be; nothing is defined at import time."""

import subprocess
import sys

import pytest
from support.runs import ROOT

from jaxllm import cli
from jaxllm.config import ConfigError, RunConfig
from jaxllm.serve.settings import ServeConfig

ENTRY_POINTS = ["jaxllm.train", "jaxllm.serve", "jaxllm.plan", "jaxllm.convert", "jaxllm.export", "jaxllm.launch",
                "jaxllm.data.prepare", "jaxllm.data.tokenizer"]  # fmt: skip


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_answers_help(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith(f"usage: python -m {module}"), done.stderr
    if module in ("jaxllm.train", "jaxllm.plan", "jaxllm.serve"):
        assert "config fields (--config.FIELD=VALUE):" in done.stdout
        row = next(line for line in done.stdout.splitlines() if line.strip().startswith("model.hidden "))
        assert row.split()[1:4] == ["int", "128", "the"] and "residual stream" in row
    if module == "jaxllm.serve":
        assert any(line.strip().startswith("serve.request_timeout_s ") for line in done.stdout.splitlines())


def test_overrides_are_parsed_by_their_fields_types():
    argv = ["--workdir", "w", "--config.train.steps=5", "--config.model.num_kv_heads", "None",
            "--config.serve.ppl_reject=true", "--config.model.norm=layernorm"]  # fmt: skip
    rest, texts = cli.split_overrides(argv)
    assert rest == ["--workdir", "w"]
    typed = cli.typed_overrides(texts, [ServeConfig, RunConfig])
    assert typed == {"train.steps": 5, "model.num_kv_heads": None, "serve.ppl_reject": True,
                     "model.norm": "layernorm"}  # fmt: skip
    assert RunConfig().overridden({k: v for k, v in typed.items() if not k.startswith("serve.")}).train.steps == 5


@pytest.mark.parametrize(
    "argument, message",
    [
        ("--config.train.steps=five", "--config.train.steps=five: the field takes an integer"),
        ("--config.parallel.zero1=maybe", "--config.parallel.zero1=maybe: the field takes true or false"),
        ("--config.train.stepz=5", r"--config.train.stepz: .* no such field; did you mean --config.train.steps\?"),
        ("--config.trian.steps=5", r"--config.trian.steps: .* no such field; did you mean --config.train.steps\?"),
        ("--config.train.zzzz=5", "--config.train.zzzz: the config has no such field; see a command's --help"),
        ("--config.model.rope_scaling=x", "--config.model.rope_scaling is a section; set one of its fields"),
        ("--config.train.steps", "--config.train.steps has no value; write --config.train.steps=VALUE"),
    ],
)
def test_a_bad_override_is_refused_naming_the_field(argument, message):
    with pytest.raises(ConfigError, match=message):
        cli.typed_overrides(cli.split_overrides([argument])[1])


def test_a_value_outside_a_fields_choices_is_refused_where_the_config_is_built():
    with pytest.raises(ConfigError, match="model.norm='batchnorm' is unknown; use one of .'rmsnorm', 'layernorm'"):
        RunConfig().overridden(cli.typed_overrides({"model.norm": "batchnorm"}))


def test_importing_the_commands_defines_no_flags():
    probe = ("import absl.flags, jaxllm.train.__main__, jaxllm.serve.__main__, jaxllm.plan.__main__; "
             "print(sorted(absl.flags.FLAGS))")  # fmt: skip
    flags = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "config" not in flags and "workdir" not in flags, flags


@pytest.mark.parametrize("flag", ["--workdir", "--checkpoint"])
def test_serving_a_run_that_does_not_exist_says_so_and_creates_nothing(flag, tmp_path):
    missing = tmp_path / "runs" / "tiyn"
    done = subprocess.run([sys.executable, "-m", "jaxllm.serve", flag, str(missing)], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode != 0
    assert f"{missing} does not exist: no such run or export; pass the --workdir of a training run" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_serving_imports_nothing_of_training():
    """(optax still loads: flax.nnx imports it for its own TrainState.)"""
    probe = "import sys, jaxllm.serve.__main__; print(sorted(m for m in sys.modules if m.startswith('jaxllm.train')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


