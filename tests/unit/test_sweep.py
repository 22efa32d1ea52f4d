"""The sweep's pieces without running it: its hand layouts, a refused layout's row, the fit of the
efficiency constants (against tables the planner's own model generates) and the planner reading a
fitted file back. `tests/e2e/test_sweep_cli.py` runs a sweep."""

import functools
import re

import numpy as np
import pytest
from support.runs import small_config

from jaxllm.config import load_config
from jaxllm.plan import fit, sweep
from jaxllm.plan.__main__ import main as plan_main
from jaxllm.plan.estimate import estimate
from jaxllm.plan.hardware import ACCELERATORS, DEFAULT_EFFICIENCY, Efficiency
from jaxllm.plan.search import Layout

H100 = ACCELERATORS["h100-80gb"]


def synthetic(rows: list[sweep.Row], truth: Efficiency, noise: float = 0.0) -> list[dict]:
    """The rows as `fit` takes them, with step times the planner's model gives at `truth`."""
    rng = np.random.default_rng(0)
    table = [{k: r.planned[k] for k in fit.TERMS} for r in rows if r.planned]
    return [t | {"measured_step_s": fit.predict(t, truth) * (1 + noise * rng.standard_normal())} for t in table]


@functools.cache
def layouts_of_8b() -> list[sweep.Row]:
    """The 8B config's 30 fastest layouts on 16 H100s and the hand layouts: compute-bound and
    communication-bound steps, with and without transfers outlasting compute."""
    return sweep.plan_rows(load_config("configs/8b.py", {}), 16, H100, top=30)


def test_hand_layouts_are_tensor_8_the_deepest_pipeline_and_tensor_4_by_stage_2():
    tiny = load_config("configs/tiny.py", {})  # 2 QKV groups: stage 2 is the deepest pipeline
    got = {(x.tensor, x.stage, x.data, x.microbatches) for x in sweep.hand_layouts(tiny, 8, (1, 2))}
    assert got == {(8, 1, 1, 1), (1, 2, 4, 2), (1, 2, 4, 4), (4, 2, 1, 2), (4, 2, 1, 4)}
    deep = small_config(num_layers=8, qkv_share_every=1).updated(train=dict(batch_size=32))
    assert {x.stage for x in sweep.hand_layouts(deep, 8, (1,))} == {1, 8, 2}


def test_a_layout_the_config_refuses_keeps_its_row_with_the_reason():
    rows = sweep.plan_rows(load_config("configs/tiny.py", {}), 8, H100, top=1)
    lines = sweep.table(rows, H100, "cpu")
    assert len(lines) == 3 + len(rows)  # a title, two header lines, one line per layout
    (refused,) = [line for line in lines if "tensor 8" in line]
    assert "refused: model.num_heads=4 is not divisible by parallel.tensor=8" in refused
    planned = [line for line in lines[3:] if "refused" not in line]
    assert planned and all(line.count(" | -") == 5 for line in planned)  # planned, nothing measured yet


@pytest.mark.parametrize("truth", [Efficiency(0.5, 0.5), Efficiency(0.3, 0.9), Efficiency(0.9, 0.6)])
def test_the_fit_recovers_the_efficiencies_a_table_was_made_with(truth):
    table = synthetic(layouts_of_8b(), truth)
    assert len(table) >= 30 and any(t["exposed_s"] > 0 for t in table) and any(t["overlapped_s"] > 0 for t in table)
    fitted, error = fit.fit(table)
    assert fitted.matmul == pytest.approx(truth.matmul, rel=1e-6)
    assert fitted.link == pytest.approx(truth.link, rel=1e-6)
    assert error < 1e-9


def test_the_fit_of_a_noisy_table_lands_near_the_truth_and_keeps_what_it_cannot_see():
    fitted, error = fit.fit(synthetic(layouts_of_8b(), Efficiency(0.5, 0.4), noise=0.02))
    assert fitted.matmul == pytest.approx(0.5, rel=0.1) and fitted.link == pytest.approx(0.4, rel=0.1)
    assert 0 < error < 0.05
    # transfers outlast compute in every step: the matmul efficiency stays the default
    slow = Efficiency(0.9, 0.2)
    table = synthetic(layouts_of_8b(), slow)
    hidden = [t for t in table if t["overlapped_s"] / slow.link > t["compute_s"] / slow.matmul]
    assert len(hidden) >= 20
    slow_links, _ = fit.fit(hidden)
    assert slow_links.matmul == DEFAULT_EFFICIENCY.matmul and slow_links.link == pytest.approx(0.2)
    # no communication anywhere: the link efficiency stays the default, the matmul one is fitted
    alone, _ = fit.fit([{"compute_s": c, "exposed_s": 0.0, "overlapped_s": 0.0, "measured_step_s": c / 0.25}
                        for c in (1.0, 2.0, 3.0)])  # fmt: skip
    assert alone.matmul == pytest.approx(0.25) and alone.link == DEFAULT_EFFICIENCY.link


def test_the_planner_reads_a_fitted_file_and_its_estimates_follow(tmp_path, capsys):
    cfg = load_config("configs/tiny.py", {"parallel.stage": 2, "parallel.microbatches": 4, "parallel.tensor": 4})
    path = tmp_path / "fit.json"
    half = Efficiency(DEFAULT_EFFICIENCY.matmul / 2, DEFAULT_EFFICIENCY.link / 4)
    fit.save(path, half, 0.0, [{"source": "hand"}], {"backend": "gpu", "device_kind": "NVIDIA H100"})
    loaded = fit.load(path)
    assert (loaded.matmul, loaded.link) == (half.matmul, half.link) and str(path) in loaded.source
    default, fitted = estimate(cfg, H100), estimate(cfg, H100, loaded)
    assert fitted.compute == pytest.approx(2 * default.compute) and default.exposed > 0
    assert fitted.exposed == pytest.approx(4 * default.exposed)

    overrides = ["--config.parallel.stage=2", "--config.parallel.microbatches=4", "--config.parallel.tensor=4"]
    plan_main(["--config", "configs/tiny.py", *overrides])
    before = capsys.readouterr().out
    plan_main(["--config", "configs/tiny.py", *overrides, "--efficiency", str(path)])
    after = capsys.readouterr().out

    def tokens_per_s(out):  # the H100 line of the estimate: "→ step X s, N tokens/s, MFU M"
        line = next(line for line in out.splitlines() if line.strip().startswith("h100-80gb"))
        return float(re.search(r"([\d,]+) tokens/s", line).group(1).replace(",", ""))

    assert tokens_per_s(after) == pytest.approx(tokens_per_s(before) * default.step / fitted.step, rel=1e-4)
    assert "matmuls at 38% of the dense peak" in after and f"(fitted: {path}, measured on gpu" in after
    assert "matmuls at 75% of the dense peak" in before


def test_an_unreadable_efficiency_file_is_an_error_not_a_crash(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"matmul_efficiency": 0}')
    with pytest.raises(fit.FitError, match="cannot read efficiencies"):
        fit.load(path)
    with pytest.raises(SystemExit, match="error: cannot read efficiencies"):
        plan_main(["--config", "configs/tiny.py", "--efficiency", str(path)])


def test_layout_words_and_the_planned_communication_share():
    assert sweep.describe(Layout(4, 2, 1, 1, "none", 8, 1, False)) == "tensor 4 × stage 2, gpipe, 8 micro"
    e = estimate(load_config("configs/tiny.py", {"parallel.tensor": 4, "parallel.data": 2}), H100)
    hidden = min(e.overlapped, e.compute)  # data-parallel transfers behind compute are not exposed
    assert 0 < e.comm_share < 1 and e.comm_share == pytest.approx((e.exposed + e.overlapped - hidden) / e.step)
