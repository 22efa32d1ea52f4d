"""The docs' commands that need a process of their own, run as written from the repository root."""

import os
import pathlib
import re
import subprocess
import sys

from support.docs import ROOT, runnable_block


def test_docs_planner_commands_run_as_written():
    """The planner page's commands, in the repo root: the 120B weights line the precision page
    quotes and the count of layouts the planner page gives are what they print."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python` is this one
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", runnable_block("docs/planner.md", "plan-120b")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    quoted = re.search(r"^weights, GB: .*$", (ROOT / "docs" / "precision.md").read_text(), re.M).group(0)
    assert quoted in done.stdout.splitlines()
    fit, valid = re.search(r"finds (\d+) of (\d+) valid layouts", (ROOT / "docs" / "planner.md").read_text()).groups()
    assert f"layouts for 64 × A100: {valid} pass the config's checks, {fit} fit" in done.stdout  # as the page says
