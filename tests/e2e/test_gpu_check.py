"""`scripts/gpu_check.py` runs from start to end on CPU, with the 1B config shrunk: every check
reports, what a CPU can judge passes, and what only a GPU can show is skipped with its reason.
The GPU's figures themselves come from running it on one (docs/benchmarks.md)."""

import re
import sys

import pytest
from support.runs import ROOT, run

pytestmark = pytest.mark.minutes(4)  # about 4 min on 2 cores: scheduled first (tests/conftest.py)

SHRUNK = ["--config.model.num_layers=4", "--config.model.hidden=64", "--config.model.num_heads=4",
          "--config.model.num_kv_heads=4", "--config.model.mlp=128", "--config.model.max_seq_len=256"]  # fmt: skip


def test_gpu_check_runs_every_check_on_cpu():
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--config", "configs/1b.py", *SHRUNK,
               "--batch", "2", "--seq", "64", "--steps", "1", "--decode-context", "64"]  # fmt: skip
    out = run(command, devices=1).stdout
    lines = re.findall(r"^(PASS|FAIL|SKIP)  ([^:]+): (.*)$", out, re.M)
    claims = {claim: (word, figure) for word, claim, figure in lines}
    assert not [line for line in lines if line[0] == "FAIL"], out
    for claim in ("fp8 projection forward error", "fp8 projection dx error", "fp8 projection dw error"):
        assert claims[claim][0] == "PASS", claims[claim]
    for prefix in ("attention", "train MFU", "compiled memory", "profile of one step", "fp8 train step",
                   "fp8 projections are cuBLASLt", "decode near the bandwidth limit, 1", "decode near the bandwidth "
                   "limit, 8", "paged attention", "int8 weights", "an int8 KV cache", "host offload"):  # fmt: skip
        assert any(claim.startswith(prefix) for claim in claims), f"no line for {prefix!r}:\n{out}"
    assert "device time by category" in out  # the profile's summary
    assert f"3 passed, 0 failed, {len(lines) - 3} skipped" in out
