"""The planner against independent references: Megatron-LM's published parameter counts, the
compiled step's collectives (counted with loop trip counts), the compiler's memory, the real KV
cache, the pipeline's own schedule; its search, pictures and the docs page it writes."""

import collections
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.runs import ROOT, small_config
from test_layouts import LAYOUTS

from jaxllm import plan
from jaxllm.config import PIPELINE_SCHEDULES, ModelConfig, Schedule, load_config
from jaxllm.model.cache import KVCache
from jaxllm.parallel import timetable
from jaxllm.parallel.mesh import make_mesh
from jaxllm.plan.comm import by_kind, communication
from jaxllm.plan.estimate import estimate, link_bandwidth
from jaxllm.plan.hardware import ACCELERATORS, accelerator_of
from jaxllm.plan.hlo import collective_bytes
from jaxllm.plan.params import megatron_extras, megatron_formula
from jaxllm.plan.plot import BUBBLE, CELL_KINDS, draw_measured_steps, schedule_grid, timetable_grid
from jaxllm.plan.scale_doc import page
from jaxllm.plan.search import search
from jaxllm.train.dry_run import AS_ON_GPU, lower_abstract_step, peak_bytes
from jaxllm.train.step import init_params

# Narayanan et al. 2021, Table 1: heads, hidden, layers → parameters (billions); V 51200, s 2048.
MEGATRON_TABLE_1 = [(32, 4096, 36, 7.5), (80, 10240, 60, 76.1), (128, 20480, 105, 529.6), (160, 25600, 128, 1008.0)]


@pytest.mark.parametrize("heads, hidden, layers, billions", MEGATRON_TABLE_1)
def test_parameters_match_megatron_table_1_under_its_convention(heads, hidden, layers, billions):
    model = ModelConfig(num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=heads, mlp=4 * hidden,
                        vocab_size=51200, mlp_activation="gelu", norm="layernorm", tie_embeddings=True,
                        qkv_share_every=1)  # fmt: skip
    ours = plan.param_counts(model)["total"]
    theirs = ours + sum(megatron_extras(model, 2048).values())
    tolerance = 0.005 * billions + 0.05
    assert abs(theirs / 1e9 - billions) <= tolerance
    assert abs(megatron_formula(layers, hidden, 51200, 2048) / 1e9 - billions) <= tolerance
    assert theirs - ours == 2048 * hidden + layers * 9 * hidden  # positions; biases of qkv, out, fc1, fc2


def _comm_config(layout: dict):
    cfg = small_config(num_layers=8, hidden=128, num_heads=8, num_kv_heads=8, mlp=384, vocab_size=1024, remat="full")
    cfg = cfg.updated(model=dict(max_seq_len=128))
    layout = dict(layout)
    cfg = cfg.updated(
        train=dict(seq_len=128, batch_size=16, grad_accum_steps=layout.pop("grad_accum_steps", 1)), parallel=layout
    )
    return cfg


MORE = {  # pipelines, and ZeRO-1 with gradient accumulation (reduce-scattered into the moments' layout)
    "data8 grad_accum 2": dict(data=8, grad_accum_steps=2),
    "data2xstage2xtensor2": dict(data=2, stage=2, tensor=2, microbatches=4),
    "fsdp2xstage2xtensor2 sequence parallel": dict(fsdp=2, stage=2, tensor=2, microbatches=4, sequence_parallel=True),
}


@pytest.mark.parametrize("layout", [*LAYOUTS.values(), *MORE.values()], ids=[*LAYOUTS, *MORE])
def test_communication_matches_the_compiled_step(layout):
    """Bytes reduced, gathered and permuted per device per step: the planner's against the compiled
    train step's collectives, each counted as often as the loops around it run."""
    cfg = _comm_config(layout)
    hlo = lower_abstract_step(cfg, make_mesh(cfg.parallel)).compile(compiler_options=AS_ON_GPU).as_text()
    compiled, planned = collective_bytes(hlo), by_kind(communication(cfg, backend="cpu"))
    assert set(planned) == set(compiled), (planned, compiled)
    for kind in compiled:
        assert 0.95 <= planned[kind] / compiled[kind] <= 1.05, (kind, planned[kind], compiled[kind])


TIMETABLED = {
    "1f1b data2xstage2xtensor2": dict(data=2, stage=2, tensor=2, microbatches=4, schedule="1f1b"),
    "1f1b fsdp2xstage2xtensor2 sequence parallel": dict(
        fsdp=2, stage=2, tensor=2, microbatches=4, schedule="1f1b", sequence_parallel=True
    ),
    "interleaved data2xstage2xfsdp2": dict(
        data=2, stage=2, fsdp=2, microbatches=4, repeats=2, schedule="interleaved_1f1b"
    ),
    "zero bubble data2xstage2xtensor2": dict(data=2, stage=2, tensor=2, microbatches=4, schedule="zero_bubble"),
    "interleaved zero bubble data2xstage2xfsdp2": dict(
        data=2, stage=2, fsdp=2, microbatches=4, repeats=2, schedule="interleaved_zero_bubble"
    ),
}


@pytest.mark.parametrize("layout", TIMETABLED.values(), ids=TIMETABLED.keys())
def test_a_timetables_permutes_are_the_planners(layout):
    """A timetable-driven pipeline hands activations on and gradients back in every step of its
    table, idle stages included: the planner's permuted bytes are the compiled step's. (Its other
    collectives sit in branches a stage skips in some steps, which a count of the compiled program
    cannot tell from the steps that run them, so only these are held to it.)"""
    cfg = _comm_config(layout)
    hlo = lower_abstract_step(cfg, make_mesh(cfg.parallel)).compile(compiler_options=AS_ON_GPU).as_text()
    compiled, planned = collective_bytes(hlo), by_kind(communication(cfg, backend="cpu"))
    assert planned["permute"] == pytest.approx(compiled["permute"], rel=1e-6)


def test_memory_estimate_is_within_15_percent_of_the_compiler_for_the_tiny_config():
    cfg = load_config("configs/tiny.py")
    cfg = cfg.updated(parallel=dict(data=1))
    compiled = lower_abstract_step(cfg, make_mesh(cfg.parallel, jax.devices()[:1])).compile(compiler_options=AS_ON_GPU)
    assert 0.85 <= plan.memory(cfg)["total"] / peak_bytes(compiled.memory_analysis()) <= 1.15


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_kv_cache_bytes_equal_the_real_cache(dtype):
    cfg = small_config(num_kv_heads=4)
    cache = KVCache.empty(cfg.model, slots=3, max_len=40, dtype=dtype)
    real = sum(a.nbytes for a in jax.tree.leaves((cache.keys, cache.values)))
    name = {"bfloat16": "bf16", "int8": "int8"}[dtype]
    assert plan.kv_cache_bytes(cfg.model, 3, 40, name) == real
    assert plan.kv_cache_bytes(cfg.model, 3, 40, name, tensor=2) == real / 2


@pytest.mark.parametrize("weights, kv", [("fp32", "float32"), ("bf16", "int8")])
def test_decode_limit_reads_the_real_weights_and_cache_once(weights, kv):
    cfg = small_config(num_kv_heads=4)
    params = init_params(cfg)
    if weights == "bf16":
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    cache = KVCache.empty(cfg.model, slots=3, max_len=40, dtype=kv)
    read = sum(a.nbytes for a in jax.tree.leaves((params, cache.keys, cache.values)))
    kv_name = {"float32": "fp32", "int8": "int8"}[kv]
    assert plan.decode_bytes(cfg.model, 3, 40, weights, kv_name) == read
    assert plan.decode_limit(cfg.model, 3, 40, 1e12, weights, kv_name) == pytest.approx(3 * 1e12 / read)


@pytest.mark.parametrize("kind, stages, repeats, microbatches", [("1f1b", 4, 1, 8), ("interleaved_1f1b", 2, 2, 4)])
def test_pictured_timetable_forwards_and_back_propagates_each_microbatch(kind, stages, repeats, microbatches):
    """The picture of a timetable: each stage's forward row and backward row hold every microbatch
    once per chunk, and the first backward comes after the stage's first forward."""
    grid = timetable_grid(Schedule(stages, repeats, microbatches, kind))
    assert grid.shape[0] == 2 * stages
    for s in range(stages):
        forward, backward = grid[2 * s], grid[2 * s + 1]
        for row in (forward, backward):
            assert sorted(row[row != BUBBLE]) == sorted(list(range(microbatches)) * repeats)
        assert np.argmax(forward != BUBBLE) < np.argmax(backward != BUBBLE)


@pytest.mark.parametrize("stages, repeats, microbatches", [(4, 1, 32), (2, 2, 4), (4, 2, 8), (3, 1, 1)])
def test_pictured_schedule_runs_every_microbatch_once_per_stage_and_repeat(stages, repeats, microbatches):
    schedule = Schedule(stages, repeats, microbatches)
    grid = schedule_grid(schedule)
    assert grid.shape == (stages, schedule.iterations)
    assert np.isclose((grid == BUBBLE).mean(), schedule.bubble)
    for stage in grid:  # each microbatch once per repeat, in order, one iteration behind the stage before
        assert list(stage[stage != BUBBLE]) == list(range(microbatches)) * repeats
    assert (np.argmax(grid != BUBBLE, axis=1) == np.arange(stages)).all()


def test_a_profiled_steps_picture_draws_each_stages_work_as_the_table_names_it():
    """`draw_measured_steps`: each loop step as long as its busiest stage, each stage's work one bar
    of the colour of what the table has it run there (none where it runs nothing), over a grey bar
    as long as the whole loop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedule = Schedule(stages=4, repeats=1, microbatches=4, kind="1f1b")  # with steps that run only the loss
    table = timetable.build("1f1b", 4, 4, 1)
    forward, backward = table.forward != timetable.IDLE, table.backward != timetable.IDLE
    loss = np.broadcast_to(table.loss_steps[:, None], forward.shape)
    work = np.random.default_rng(0).uniform(1e-4, 2e-4, forward.shape) * (1 + forward + 2 * backward + loss)
    fig = plt.figure()
    ax = fig.subplots()
    draw_measured_steps(ax, schedule, work, 0.3)
    bars = [b for b in ax.patches if b.get_width() > 0]
    grey = [b for b in bars if b.get_facecolor()[:3] == matplotlib.colors.to_rgb("#d9d9d9")]
    assert [b.get_width() for b in grey] == pytest.approx([work.max(axis=1).sum() * 1e3] * 4)
    colours = {name: matplotlib.colors.to_rgb(c) for name, c in CELL_KINDS.items()}
    drawn = collections.Counter(next(n for n, c in colours.items() if b.get_facecolor()[:3] == c) for b in bars
                                if b not in grey)  # fmt: skip
    only_loss = loss & ~forward & ~backward
    assert drawn == {"forward and backward": (forward & backward).sum(), "forward": (forward & ~backward).sum(),
                     "backward": (backward & ~forward).sum(), "share of the loss only": only_loss.sum()}  # fmt: skip
    plt.close(fig)


def test_links_follow_the_mesh_order_over_nodes_of_8():
    a100, sizes = ACCELERATORS["a100-80gb"], dict(data=2, fsdp=2, stage=4, tensor=8)
    assert link_bandwidth(("tensor",), sizes, a100) == a100.nvlink
    assert link_bandwidth(("stage",), sizes, a100) == a100.network
    assert link_bandwidth(("fsdp",), dict(data=8, fsdp=2, stage=1, tensor=4), a100) == a100.nvlink
    assert link_bandwidth(("data", "fsdp"), dict(data=8, fsdp=2, stage=1, tensor=4), a100) == a100.network


def test_estimate_moves_with_the_hardware_and_the_layout():
    cfg = load_config("configs/120b.py")
    a100, h100 = (estimate(cfg, ACCELERATORS[k]) for k in ("a100-80gb", "h100-80gb"))
    assert math.isclose(a100.compute / h100.compute, 989 / 312)  # compute-bound part scales with peak FLOP/s
    assert 450 / 300 < a100.exposed / h100.exposed < 50 / 25  # tensor on NVLink 3 vs 4, stage on HDR vs NDR
    fp8 = cfg.updated(model=dict(fp8=dict(enabled=True)))  # the H100's FP8 peak is 1979 TFLOP/s; the A100 has none
    assert estimate(fp8, ACCELERATORS["h100-80gb"]).compute == pytest.approx(h100.compute * 989 / 1979)
    assert estimate(fp8, ACCELERATORS["a100-80gb"]).compute == pytest.approx(a100.compute)


@pytest.mark.parametrize("kind, row", [
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"), ("cpu", None),
])  # fmt: skip
def test_device_kinds_read_as_their_own_rows(kind, row):
    """JAX's `device_kind` of each part (as nvidia-smi names them) picks its own row, so MFU and
    plans use a 40 GB A100's memory and a PCIe H100's clocks and links, not the SXM 80 GB parts'."""
    assert accelerator_of(kind) is (ACCELERATORS[row] if row else None)


def test_search_ranks_every_schedule_by_step_time_and_memory():
    """The 1B config on 16 A100s: a layout of every schedule fits, each tried once. Each
    zero-bubble schedule's best is faster than its unsplit twin's (a smaller bubble, no recomputed
    forward) and holds more memory at the same layout (the residuals and taps)."""
    fitting = search(load_config("configs/1b.py"), 16, ACCELERATORS["a100-80gb"]).fitting
    assert len({c.layout for c in fitting}) == len(fitting)
    best = {}
    for c in fitting:
        best.setdefault(c.layout.schedule if c.layout.stage > 1 else "none", c)
    assert set(best) == {"none", *PIPELINE_SCHEDULES}
    for split, whole in (("zero_bubble", "1f1b"), ("interleaved_zero_bubble", "interleaved_1f1b")):
        assert best[split].estimate.step < best[whole].estimate.step
        twin = next(c for c in fitting if c.layout == dataclasses.replace(best[split].layout, schedule=whole))
        assert twin.memory < best[split].memory and twin.estimate.step > best[split].estimate.step


def test_at_2048_a100s_the_120b_pipelines_again_as_the_pipeline_page_says():
    """docs/pipeline.md's row for 2,048 A100s (global batch 1,024 sequences): the fastest layout has
    two stages of two chunks each, interleaved 1F1B first and circular within 1 % of its step time
    in less memory, and 1F1B's and no pipeline's best step times are the page's."""
    cfg = load_config("configs/120b.py").updated(train=dict(batch_size=1024, grad_accum_steps=1))
    fitting = search(cfg, 2048, ACCELERATORS["a100-80gb"]).fitting
    best = {}
    for c in fitting:
        best.setdefault(c.layout.schedule if c.layout.stage > 1 else "none", c)
    top = fitting[0].layout
    assert (top.stage, top.repeats, top.schedule) == (2, 2, "interleaved_1f1b")
    # Their put-off weight passes' taps and held units' residuals do not fit beside 120B's weights.
    assert "zero_bubble" not in best and "interleaved_zero_bubble" not in best
    assert best["circular"].estimate.step == pytest.approx(best["interleaved_1f1b"].estimate.step, rel=1e-2)
    assert best["circular"].memory < best["interleaved_1f1b"].memory
    row = re.search(r"^\| 2,048 \(1\) \| (.*)$", (ROOT / "docs" / "pipeline.md").read_text(), re.M).group(1)
    quoted = [float(x) for x in re.findall(r"([\d.]+) s(?:\*\*)?,", row)]
    assert quoted == [round(best[k].estimate.step, 1) for k in ("none", "1f1b", "interleaved_1f1b")]


def test_docs_scale_page_is_what_the_planner_prints_today():
    assert (ROOT / "docs" / "scale.md").read_text() == page(), "run: python -m jaxllm.plan.scale_doc > docs/scale.md"


def test_benchmarks_page_quotes_the_planners_mfu_for_the_gpu_check_step():
    cfg = load_config("configs/1b.py").updated(parallel=dict(fsdp=1), train=dict(batch_size=8, grad_accum_steps=1))
    planned = [estimate(cfg.updated(model=dict(remat=r)), ACCELERATORS["h200"]).mfu for r in ("full", "selective")]
    quoted = re.search(r"the planner estimates (\d+) % MFU \(`full`\) and (\d+) % \(`selective`\)",
                       (ROOT / "docs" / "benchmarks.md").read_text())  # fmt: skip
    assert [int(q) for q in quoted.groups()] == [int(100 * p) for p in planned]
