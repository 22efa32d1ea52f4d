"""The 120B config's dry run as the training page writes it, in a process of its own with 64 fake
devices: it fits an 80 GB GPU, and the parallelism page quotes its figures."""

import os
import re
import shlex
import subprocess
import sys

from support.docs import runnable_block
from support.runs import ROOT

from jaxllm import plan
from jaxllm.config import load_config


def test_120b_fits_an_80gb_gpu_with_headroom_in_its_dry_run():
    """The whole 120B step on 64 fake devices: peak ≤ 67 GiB (80 GB less 10 %), and the planner's
    memory and collectives beside the compiler's figures, within 10 % of them. The command is the
    training page's, as written."""
    python, *args = shlex.split(runnable_block("docs/training.md", "dry-run-120b"), comments=True)
    assert python == "python", python
    cmd = [sys.executable, *args]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "mesh: data 1 × fsdp 8 × stage 1 × tensor 8 = 64 cpu devices" in out
    peak = float(re.search(r"peak\s+([\d.]+) GiB", out).group(1))
    planned = float(re.search(r"  total\s+([\d.]+) GiB", out).group(1))
    assert peak <= 67, out
    # fp32 params + Adam moments = 12 bytes each, every parameter split 64 ways (tensor × fsdp),
    # plus a negligible batch
    counts = plan.param_counts(load_config("configs/120b.py").model)
    want = counts["total"] * 12 / 64 / 2**30
    assert abs(float(re.search(r"arguments\s+([\d.]+) GiB", out).group(1)) - want) < 0.02
    assert 0.9 < planned / peak < 1.1, out
    # What the dry run leaves out of XLA:CPU's default compile: an fp32 twin (4 bytes) of a layer
    # group's gathered bf16 weights at most, which the planner counts with their fp32 gradient (2 + 4 bytes).
    cpu_peak = float(re.search(r"peak as XLA:CPU compiles by default: ([\d.]+) GiB", out).group(1))
    gathered = float(re.search(r"  gathered weights.*?([\d.]+) GiB", out).group(1))
    assert 0 <= cpu_peak - peak <= gathered * 4 / 6, out
    for component in ("params", "optimizer state", "fp32 gradients", "gathered weights", "activations (remat group)"):
        assert re.search(rf"  {re.escape(component)}.*\d GiB", out), component
    # The planner's collectives against the compiled program's, loops counted (as XLA:CPU runs them).
    ratios = dict(re.findall(r"^  (reduce|gather|permute) .*planned / compiled = ([\d.]+)$", out, re.M))
    assert set(ratios) == {"reduce", "gather"}, out[-2000:]  # no pipeline: nothing permuted
    assert all(0.9 <= float(r) <= 1.1 for r in ratios.values()), ratios
    # The parallelism page's table is this output, and it says which attention each total is for.
    page = (ROOT / "docs" / "parallelism.md").read_text()
    table = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+)", page, re.M))
    printed = {"arguments (fp32 params + Adam moments)": r"arguments\s+([\d.]+) GiB",
               "temporaries": r"temporaries\s+([\d.]+) GiB", "peak": r"  peak\s+([\d.]+) GiB",
               "peak as XLA:CPU compiles by default": r"by default: ([\d.]+) GiB",
               "planner total for this compile, XLA attention (`plan.memory`)": r"  total\s+([\d.]+) GiB"}  # fmt: skip
    assert {row: table[row] for row in printed} == {row: re.search(rx, out).group(1) for row, rx in printed.items()}
    cudnn = plan.memory(load_config("configs/120b.py"))["total"] / 2**30
    assert f"with cuDNN attention, is {cudnn:.1f} GiB" in re.sub(r"\s+", " ", page)
