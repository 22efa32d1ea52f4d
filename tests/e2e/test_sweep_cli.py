"""`python -m jaxllm.plan --sweep`: a short run of each hand layout of a node on 8 fake CPU devices,
planned against measured in one row per layout, a refused layout's reason in its row, `--fit`
writing the fitted efficiencies with the table, and `--efficiency` reading them back: the planner
page's commands, shrunk by later flags."""

import json
import re
import shlex
import sys

from support.docs import runnable_block
from support.runs import cli_data_flags, run

SMALL = ["--config.model.num_layers=4", "--config.model.hidden=64", "--config.model.mlp=128",
         "--config.model.qkv_share_every=2", "--config.train.seq_len=16", "--config.train.batch_size=8",
         "--config.train.sample_tokens=1", "--config.data.eval_batches=1"]  # fmt: skip


def test_a_sweep_prints_planned_against_measured_per_layout_and_fits_the_efficiencies(tmp_path):
    sweep_line, plan_line = runnable_block("docs/planner.md", "plan-sweep").strip().splitlines()
    env, python, *args = shlex.split(sweep_line, comments=True)
    assert (env, python) == ("XLA_FLAGS=--xla_force_host_platform_device_count=8", "python")  # run() sets 8 devices
    fitted = tmp_path / "fit.json"
    args = [str(fitted) if a == "runs/sweep-tiny.json" else a for a in args]
    command = [sys.executable, *args, "--top-sweep", "0", "--microbatches", "1", "--sweep-steps", "3",
               "--sweep-dir", str(tmp_path / "sweep"), *cli_data_flags(tmp_path / "data"), *SMALL]  # fmt: skip
    out = run(command).stdout
    assert "sweep: planned on H100 | measured on cpu" in out, out[-3000:]
    rows = {m.group(2).strip(): m.group(3) for m in re.finditer(r"^  (\d+) +hand +(.+?)  +(\S.*)$", out, re.M)}
    pipelines = ("stage 2 × data 4, gpipe, 2 micro", "tensor 4 × stage 2, gpipe, 2 micro")
    assert rows.keys() == {"tensor 8", *pipelines}, out[-3000:]
    assert rows["tensor 8"].startswith("refused: model.num_heads=4 is not divisible by parallel.tensor=8")
    for name in pipelines:
        cells = re.findall(r"(\S+) \| (\S+)", rows[name])
        assert len(cells) == 5, rows[name]  # step s, tokens/s, peak MiB, comm, bubble: planned | measured
        assert "-" not in [x for cell in cells for x in cell], rows[name]  # nothing left unmeasured
        assert all(float(p.rstrip("%")) > 0 and float(m.rstrip("%")) > 0 for p, m in cells), rows[name]
    saved = json.loads(fitted.read_text())
    assert saved["matmul_efficiency"] > 0 and saved["link_efficiency"] > 0 and saved["fitted_on"]["backend"] == "cpu"
    assert [r["skipped"] is None for r in saved["table"]] == [False, True, True]
    measured = [r["measured"] for r in saved["table"] if r["measured"]]
    assert all(m["peak_source"] == "compiler memory_analysis" and m["peak_bytes"] > 0 for m in measured)
    assert f"wrote {fitted}" in out

    python, *args = shlex.split(plan_line, comments=True)
    planned = run([sys.executable, *[str(fitted) if a == "runs/sweep-tiny.json" else a for a in args]]).stdout
    assert f"(fitted: {fitted}, measured on cpu (cpu), 2 layouts measured)" in planned
