"""`python -m jaxllm.plan` as its users run it, each in a process of its own: the search and its
refusals, `--compile`, `--plot` as the pipeline page writes it."""

import ast
import os
import pathlib
import re
import subprocess
import sys

from support.docs import runnable_block
from support.runs import ROOT

from jaxllm import plan
from jaxllm.config import load_config, validate
from jaxllm.plan.hardware import ACCELERATORS
from jaxllm.plan.search import Layout, layouts, search


def test_pipeline_page_draws_its_timetable(tmp_path):
    """docs/pipeline.md's `--plot` command, as written, draws the interleaved timetable."""
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    command = runnable_block("docs/pipeline.md", "plot-interleaved-1f1b")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pipeline interleaved_1f1b: 2 stages × 2 chunks, 4 microbatches, 13 steps" in proc.stdout
    assert (tmp_path / "schedule.png").stat().st_size > 10_000


def test_search_lists_the_120b_layout_among_those_that_fit_64_a100s(tmp_path):
    """The CLI: `--search --gpus 64 --device a100-80gb` prints this config's layout among the
    layouts that fit, each as overrides that reproduce it; `--plot` draws the picture."""
    picture = tmp_path / "plan.png"
    cmd = [sys.executable, "-m", "jaxllm.plan", "--config", "configs/120b.py", "--search", "--gpus", "64",
           "--device", "a100-80gb", "--top", "3", "--plot", str(picture), "--convention", "megatron"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    own = re.search(r"^ +(\d+)\. step .*?(--config\.parallel.*?)  ← this config$", out, re.M)
    assert own, out[-3000:]
    cfg = load_config("configs/120b.py")
    assert own.group(2) == Layout.of(cfg).overrides()
    fitting = search(cfg, 64, ACCELERATORS["a100-80gb"]).fitting
    assert len(fitting) > int(own.group(1)) - 1 and all(c.memory <= 0.9 * 80 * 2**30 for c in fitting)
    rows = re.findall(r"^ +\d+\. step .*?GiB  (--config.*?)(?:  ← this config)?$", out, re.M)
    assert len(rows) == 4  # the top 3 and this config's
    for row in rows:  # each row's overrides give a config that passes the checks on 64 devices
        fields = dict(o.removeprefix("--config.").split("=") for o in row.split())
        validate(cfg.overridden({k: _value(v) for k, v in fields.items()}), 64)
    assert "total, Megatron-LM" in out and "fits one A100" in out
    assert picture.stat().st_size > 10_000


def test_search_on_a100_40gb_says_how_many_gpus_the_120b_needs():
    """`--search --device a100-40gb --gpus 64`: the 120B config's fp32 params, gradients and Adam
    moments alone (16 bytes a parameter, 29.8 GB a GPU over 64) leave no layout within 40 GB less
    the headroom, and the planner names the GPU count where layouts fit, each within 36 GiB."""
    cfg = load_config("configs/120b.py")
    on_40gb = search(cfg, 64, ACCELERATORS["a100-40gb"])
    assert not on_40gb.fitting and on_40gb.valid > 0 and search(cfg, 64, ACCELERATORS["a100-80gb"]).fitting
    fitting = search(cfg, 128, ACCELERATORS["a100-40gb"]).fitting
    assert fitting and all(c.memory <= 0.9 * 40 * 2**30 for c in fitting)
    cmd = [sys.executable, "-m", "jaxllm.plan", "--config", "configs/120b.py", "--search", "--gpus", "64",
           "--device", "a100-40gb", "--top", "1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = f"layouts for 64 × A100 40GB: {on_40gb.valid} pass the config's checks, 0 fit"
    assert counts in proc.stdout, proc.stdout[-2000:]
    assert (f"none fits 36.0 GiB a device on 64 GPUs; on 128, {len(fitting)} do, the fastest at "
            f"{fitting[0].memory / 2**30:.1f} GiB: {fitting[0].layout.overrides()}") in proc.stdout  # fmt: skip
    page = (ROOT / "docs" / "cluster.md").read_text()
    params = plan.param_counts(cfg.model)["total"]
    assert f"16 bytes a parameter, {16 * params / 64 / 1e9:.1f} GB a GPU" in page
    assert f"{len(fitting)} layouts fit on 128" in page


def test_a_search_that_the_checks_refuse_throughout_says_why():
    """`--search --gpus 7` for the tiny config: no layout of 7 devices passes the checks, and the
    report gives the checks' reasons, most common first, with how many layouts each refused, instead
    of searching more GPUs for memory."""
    cmd = [sys.executable, "-m", "jaxllm.plan", "--config", "configs/tiny.py", "--search", "--gpus", "7"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    refusals = [re.match(r"  (\d+) refused: (.*)", line) for line in out.splitlines() if " refused: " in line]
    counts = [int(m.group(1)) for m in refusals]
    assert "layouts for 7 × H100: 0 pass the config's checks, 0 fit" in out
    assert len(counts) == 3 and counts == sorted(counts, reverse=True), out
    cfg = load_config("configs/tiny.py")
    assert sum(counts) == len(list(layouts(cfg, 7, 8)))  # these three reasons refuse every layout
    assert refusals[0].group(2).startswith("model.num_heads=4 is not divisible by parallel.tensor=7; choose")
    assert any("train.batch_size=16 is not divisible by" in m.group(2) for m in refusals)
    assert "none fits" not in out


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except ValueError:
        return text


def test_planner_refuses_a_layout_the_trainer_would():
    cmd = [sys.executable, "-m", "jaxllm.plan", "--config", "configs/120b.py", "--config.parallel.stage=8",
           "--config.parallel.fsdp=1", "--config.parallel.microbatches=32"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "do not split into parallel.stage=8" in proc.stderr + proc.stdout


def test_plan_compile_sets_the_dry_runs_figures_beside_the_estimates():
    """`--compile` runs `python -m jaxllm.train --dry-run` with the same config and overrides in a
    process of its own (the planner imports no training code), which compiles the real step."""
    overrides = ["--config.model.num_layers=4", "--config.parallel.data=2", "--config.parallel.tensor=2"]
    cmd = [sys.executable, "-m", "jaxllm.plan", "--config", "configs/tiny.py", *overrides, "--compile"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "mesh: data 2 × fsdp 1 × stage 1 × tensor 2 = 4 cpu devices" in out
    assert f"$ -m jaxllm.train --config configs/tiny.py {' '.join(overrides)} --dry-run" in out
    planned = float(re.search(r"planned total / compiler peak = ([\d.]+)", out).group(1))
    assert 0.5 < planned < 2.0 and "all-reduce" in out
    probe = "import sys, jaxllm.plan.__main__; print(sorted(m for m in sys.modules if m.startswith('jaxllm.train')))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "[]"
