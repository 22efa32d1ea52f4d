"""The fine-tuning learning check (scripts/sft_learning_check.py, one device): a model that copies
word lists and cannot reverse them learns to reverse lists it never saw, in full and with LoRA (on
a bf16 base, and with dropout on an int8 base), and
an instruction worded otherwise changes neither the tokens it learns from nor what it learns."""

import json
import sys

import pytest
from support.runs import ROOT, run

pytestmark = pytest.mark.minutes(3)  # about 3 min on 2 cores: scheduled first (tests/conftest.py)

ACCURACY = 0.9  # exact match on the 120 held-out lists; the check reaches 1.00 for each (docs/fine-tuning.md)


def test_fine_tuning_learns_to_reverse_held_out_lists_full_and_lora(tmp_path):
    # Four fine-tunings of hundreds of steps run longer than they compile: XLA's default flags
    command = [sys.executable, str(ROOT / "scripts" / "sft_learning_check.py"), "--workdir", str(tmp_path)]
    proc = run(command, devices=1, quick=False)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["base copies"] >= ACCURACY  # knows the words and the format
    assert result["base reverses"] == 0.0  # and cannot do the task
    for name in ("full", "lora", "lora-int8", "reworded"):
        assert result[f"{name} reverses"] >= ACCURACY, result
    # Loss on completions only: the reworded prompts are longer, the learned tokens the completions' alone.
    assert result["full learned tokens"] == result["reworded learned tokens"] == result["completion tokens"]
