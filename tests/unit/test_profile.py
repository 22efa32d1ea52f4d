"""The step profiler: traces of real train steps on the 8 fake devices, read back from the trace
file jax.profiler writes; the categories, the communication share and the pipeline's measured
bubble; the health bands; the profile_steps setting; a profiled serving engine."""

import itertools
import math

import jax
import numpy as np
import pytest
from support.runs import small_config

from jaxllm.config import ConfigError, Schedule, TrainConfig
from jaxllm.parallel import timetable
from jaxllm.parallel.mesh import make_mesh
from jaxllm.profile import COLLECTIVES, OncePerRun, StepProfiler, categorize, out_of_band
from jaxllm.profile.capture import stages_of
from jaxllm.profile.trace import Op, empty_iterations, find_trace, partition, read_ops, summarize
from jaxllm.train.metrics import memory_fractions
from jaxllm.train.run import build_run
from jaxllm.train.step import compile_train_step, init_state


def _profile(tmp_path, parallel: dict, devices=None, steps: int = 2, **model):
    """Runs 1 + `steps` train steps of the small model on `parallel`, tracing all but the first
    (which compiles); returns the summary read from the trace file."""
    cfg = small_config(num_kv_heads=8, qkv_share_every=1, **model).updated(parallel=parallel)
    mesh = make_mesh(cfg.parallel, devices)
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    with jax.set_mesh(mesh):
        run = build_run(cfg, mesh)
        state, step_fn = init_state(run), compile_train_step(run)
        schedule = run.schedule
        profiler = StepProfiler((2, 1 + steps), tmp_path, module="jit_train_step", schedule=schedule,
                                stage_of=stages_of(mesh), loop_steps=timetable.steps_of(schedule))  # fmt: skip
        for step in range(1, 2 + steps):
            batch = {k: jax.device_put(rng.integers(0, 257, shape).astype(np.int32), run.batch_sharding)
                     for k in ("inputs", "targets")}  # fmt: skip
            profiler.before(step)
            state, metrics = step_fn(state, batch)
            profiler.after(step, (state, metrics))
    ops = read_ops(find_trace(tmp_path), "jit_train_step")
    runs = {op.run for op in ops}
    assert len(runs) == steps, f"the trace holds {len(runs)} executions of the step, not the {steps} profiled"
    return profiler.summary, ops


@pytest.fixture(scope="module")
def tensor8(tmp_path_factory):
    return _profile(tmp_path_factory.mktemp("tensor8"), dict(tensor=8), steps=1)[0]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _profile(tmp_path_factory.mktemp("single"), dict(data=-1), devices=jax.devices()[:1], steps=1)[0]


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """Four profiled steps of 4 stages × 4 microbatches: (summary, the trace's ops)."""
    return _profile(tmp_path_factory.mktemp("pipeline"), dict(stage=4, microbatches=4, data=2), steps=4)


@pytest.fixture(scope="module")
def pipeline(pipeline_run):
    return pipeline_run[0]


def _union(intervals) -> float:
    """The length of a union of (start, end) intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def test_communication_share_over_several_steps_is_the_exposed_collective_time_per_step(pipeline_run):
    """Four profiled steps of a pipeline (microbatches, stage shifts, gradient reductions): the
    share equals, computed apart from the profiler by interval unions per device, the time some
    collective runs and no compute does, over the device's window, averaged over devices. (Dividing
    by the whole window where a step's time belongs gives a quarter of it here.)"""
    summary, ops = pipeline_run
    assert summary.steps == 4
    start, end = min(o.start for o in ops), max(o.end for o in ops)
    compute = {"matmul", "attention", "other"}
    shares = []
    for device in {o.device for o in ops}:
        mine = [o for o in ops if o.device == device and not o.container]
        busy = [(o.start, o.end) for o in mine if o.category in compute]
        talking = [(o.start, o.end) for o in mine if o.category in COLLECTIVES]
        shares.append((_union(busy + talking) - _union(busy)) / (end - start))
    assert summary.comm_share == pytest.approx(sum(shares) / len(shares), rel=1e-6)
    assert summary.comm_share > 0.01
    assert summary.step_time == pytest.approx((end - start) * 1e-6 / 4, rel=1e-9)


def test_tensor_parallel_spends_a_larger_share_on_communication_than_one_device(tensor8, single):
    assert single.devices == 1 and tensor8.devices == 8
    assert single.comm_share == 0.0  # nothing to communicate on one device
    assert tensor8.categories["all-reduce"] > 0  # Megatron's all-reduces, as all-reduce or psum ops
    assert tensor8.comm_share > single.comm_share + 0.05
    assert tensor8.comm_share == pytest.approx(sum(tensor8.categories[c] for c in COLLECTIVES) / tensor8.step_time)


@pytest.mark.parametrize("which", ["tensor8", "single", "pipeline"])
def test_the_categories_add_up_to_the_step_time(which, request):
    summary = request.getfixturevalue(which)
    assert all(t >= 0 for t in summary.categories.values())
    assert sum(summary.categories.values()) == pytest.approx(summary.step_time, rel=1e-9)
    assert summary.categories["matmul"] > 0
    assert len(summary.top_ops) == 15 and all(0 < share <= 1 for *_, share in summary.top_ops)
    text = summary.format()
    assert "communication share" in text and "matmul" in text and "idle" in text


def test_the_pipelines_measured_bubble_is_close_to_its_analytic_bubble(pipeline):
    # GPipe's bubble: (S − 1)/(M + S − 1) of the iterations, = 3/7 for 4 stages and 4 microbatches.
    # Measured, each stage's compute in each iteration is the least of 8 samples (2 devices, 4
    # steps) of 8 fake devices sharing the host's few cores: runs measured 0.404 to 0.411 (with
    # 2 steps, 0.406 to 0.501).
    analytic = 3 / 7
    print(f"measured bubble {pipeline.bubble:.3f}, analytic {analytic:.3f}")
    assert pipeline.bubble == pytest.approx(analytic, abs=0.08)
    assert 0 < pipeline.pipeline_share < 1


@pytest.mark.parametrize("kind, repeats", [("gpipe", 1), ("circular", 2)])
def test_the_bubble_of_a_scan_pipelines_trace_is_the_lockstep_bubble_of_its_iterations(kind, repeats):
    """A trace of S = 4, M = 8: two accumulation microsteps, each a forward loop and a backward
    loop in `while`s of their own, then work outside them; every stage computes in every iteration
    (on zeros where it holds no microbatch), at a cost that differs by stage and iteration, two
    devices a stage, one of them slowed 3× (a thread waiting for a core), and a second execution
    all 2× slower; each iteration ends with its shift once the busiest stage is done. The measured
    bubble is 1 − (the work of stages that hold a microbatch) / (S · Σ each iteration's busiest
    stage), computed here from the costs and which iterations hold a microbatch (stage s holds
    forward iterations s to s + repeats·M − 1, and the backward loop runs them in reverse); with
    even costs that is (S − 1)/n."""
    n = repeats * 8 + 3
    stage_of = {str(d): d % 4 for d in range(8)}

    def cost(stage, i, backward):
        return (1 + stage) * (1 + i / n) * (2 if backward else 1)

    ops, held, lockstep = [], 0.0, 0.0
    for backward in (False, True):
        for i in range(n):
            k = n - 1 - i if backward else i
            held += sum(cost(s, i, backward) for s in range(4) if s <= k < s + repeats * 8)
            lockstep += max(cost(s, i, backward) for s in range(4))
    for run, slower in (("r", 1), ("r2", 2)):
        for device, stage in stage_of.items():
            slow = slower * (3 if device == "5" else 1)
            t = 1e5 * (run == "r2")
            for _ in range(2):
                for backward, shift in ((False, "ppermute.1"), (True, "ppermute.2")):
                    ops.append(Op(device, "while.1", t, t + 1, "other", run))
                    for i in range(n):
                        ops.append(Op(device, "fusion.1", t, t + slow * cost(stage, i, backward), "other", run))
                        t += 6 * max(cost(s, i, backward) for s in range(4)) * 2
                        ops.append(Op(device, shift, t, t + 0.5, "collective-permute", run))
                        t += 0.5
                ops.append(Op(device, "fusion.9", t, t + 50, "other", run))  # the optimizer, say
                t += 60
    summary = summarize(ops, 2, schedule=Schedule(4, repeats, 8, kind), stage_of=stage_of)
    assert summary.bubble == pytest.approx(1 - held / (4 * lockstep), rel=1e-9)
    loops = 12 * lockstep + n  # a microstep's two loops, each iteration 12 × its busiest cost and a shift
    window = 1e5 + 2 * (loops + 60) - 10  # to the end of the second execution's last op
    assert summary.pipeline_share == pytest.approx(4 * loops / window)  # the work between loops is not theirs


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory):
    return _profile(tmp_path_factory.mktemp("1f1b"), dict(stage=4, microbatches=4, data=2, schedule="1f1b"), steps=3)[0]


def _lockstep_bubble(work: np.ndarray) -> float:
    """Every stage waits for the busiest in each step: 1 − Σ work / (stages · Σ_steps max work)."""
    return float(1 - work.sum() / (work.shape[1] * work.max(axis=1).sum()))


def test_a_timetable_driven_pipelines_measured_work_follows_its_table(one_f_one_b):
    """1F1B at S = 4, M = 4 (11 loop steps), three profiled steps. Where the table gives a stage no
    work (no forward, no backward, no share of a loss), the trace shows only the buffer updates,
    far less than in any step with work: the trace's steps line up with the table's (cutting the
    loop one step off fails here). The bubble is the table's with each stage's typical cost of each
    kind of cell (which of a forward, a backward and a loss share it runs; the median of its cells
    of that kind) in every cell; and it stays near the analytic bubble, 3/7 at any backward cost
    (runs measured 0.37 to 0.39): every stage takes an equal share of the head and the loss, some
    of it in steps it would idle."""
    table = timetable.build("1f1b", 4, 4, 1)
    work = np.array(one_f_one_b.stage_work)
    assert work.shape == (table.steps, 4)
    forward, backward = table.forward != timetable.IDLE, table.backward != timetable.IDLE
    loss = np.broadcast_to(table.loss_steps[:, None], forward.shape)
    busy = forward | backward | loss
    assert work[~busy].max() < 0.5 * work[busy].min(), np.round(work * 1e3, 2)
    typical = np.zeros_like(work)
    for f, b, l_ in itertools.product((True, False), repeat=3):
        kind = (forward == f) & (backward == b) & (loss == l_)
        for s in range(4):
            if kind[:, s].any():
                typical[kind[:, s], s] = np.median(work[kind[:, s], s])
    print(
        f"measured {one_f_one_b.bubble:.3f}, with typical costs {_lockstep_bubble(typical):.3f}, "
        f"analytic {table.bubble():.3f}",
        np.round(work.T * 1e3, 2),
    )
    assert one_f_one_b.bubble == pytest.approx(_lockstep_bubble(work), rel=1e-9)
    assert one_f_one_b.bubble == pytest.approx(_lockstep_bubble(typical), abs=0.05)
    assert one_f_one_b.bubble == pytest.approx(table.bubble(), abs=0.08)
    assert 0 < one_f_one_b.pipeline_share < 1


@pytest.mark.parametrize(
    "kind, chunks", [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("interleaved_zero_bubble", 2)]
)
def test_the_timetable_bubble_of_a_trace_with_the_tables_costs_is_the_tables_bubble(kind, chunks):
    """A trace written from the table: two accumulation microsteps, each a loop in its own `while`
    after some work outside it; in the loop a forward costs 1, a backward 2 (split: its input
    gradient 1, its weight pass 1), two devices a stage,
    one of them slowed 3× in every step (a thread waiting for a core), and each step ends with its
    two permutes once the busiest stage is done. The measured bubble is the table's, exactly."""
    table = timetable.build(kind, 4, 8, chunks)
    stage_of = {str(d): d % 4 for d in range(8)}
    work = table.work()
    loop = 3 * work.max(axis=1).sum() + 0.5 * table.steps
    ops = []
    for device, stage in stage_of.items():
        slow = 3 if device == "5" else 1
        t = 0.0
        for _ in range(2):
            ops.append(Op(device, "fusion.9", t, t + 50, "other", "r"))  # the embedding, say
            t += 60
            ops.append(Op(device, "while.1", t, t + loop, "other", "r"))
            for step in range(table.steps):
                if work[step, stage]:
                    ops.append(Op(device, "fusion.1", t, t + slow * work[step, stage], "other", "r"))
                t += 3 * work[step].max()
                ops += [Op(device, f"ppermute.{k}", t, t + 0.5, "collective-permute", "r") for k in (1, 2)]
                t += 0.5
    summary = summarize(ops, 1, schedule=Schedule(4, chunks, 8, kind), stage_of=stage_of, loop_steps=table.steps)
    assert summary.bubble == pytest.approx(table.bubble(), rel=1e-9)
    assert np.array(summary.stage_work) == pytest.approx(work * 1e-6)
    assert summary.pipeline_share == pytest.approx(2 * loop / t)  # the work between the loops is not theirs


def test_the_out_of_band_ratios_of_real_profiles_are_warned(pipeline, tensor8, single):
    assert set(out_of_band(pipeline.metrics())) >= {"bubble_measured"}  # 43 % > 15 %
    assert "comm_share" in out_of_band(tensor8.metrics())
    assert out_of_band(single.metrics()) == {}  # no collectives, no pipeline


def test_the_empty_iterations_of_each_stage():
    assert empty_iterations(0, Schedule(4, 1, 4), backward=False) == {4, 5, 6}
    assert empty_iterations(3, Schedule(4, 1, 4), backward=False) == {0, 1, 2}
    assert empty_iterations(3, Schedule(4, 1, 4), backward=True) == {4, 5, 6}
    assert empty_iterations(1, Schedule(2, 2, 2), backward=False) == {0}


@pytest.mark.parametrize(
    "name,long_name,category",
    [
        ("all-reduce.30", "", "all-reduce"), ("psum_invariant.106", "", "all-reduce"),
        ("psum_scatter.2", "", "reduce-scatter"), ("reduce_scatter.80", "", "reduce-scatter"),
        ("all_gather.3", "", "all-gather"), ("all-gather-start.1", "", "all-gather"),
        ("all_to_all.1", "", "all-to-all"), ("ppermute.16", "", "collective-permute"),
        ("collective-permute-done.2", "", "collective-permute"),
        ("fusion.12", "%fusion.12 = f32[8]{0} all-reduce-start(f32[8]{0} %x)", "all-reduce"),
        ("dot.3", "", "matmul"), ("ynn_fusion.24", "", "matmul"), ("cudnn_fmha.1", "", "attention"),
        ("copy.434", "", "copy/transfer"), ("add_add_fusion", "", "other"),
    ],
)  # fmt: skip
def test_ops_fall_in_their_category(name, long_name, category):
    assert categorize(name, long_name) == category


def test_an_interval_goes_to_compute_before_collectives_before_idle():
    ops = [Op("0", "all-reduce.1", 0, 10, "all-reduce"), Op("0", "dot.1", 2, 6, "matmul"),
           Op("0", "while.1", 0, 20, "other"), Op("0", "copy.1", 12, 14, "copy/transfer")]  # fmt: skip
    parts = partition(ops, 0, 20)
    assert parts["matmul"] == 4 and parts["all-reduce"] == 6 and parts["copy/transfer"] == 2
    assert parts["idle"] == 8  # the while spans its body and counts in no category
    assert sum(parts.values()) == 20


def test_the_bands_warn_outside_them_and_name_the_setting():
    assert out_of_band({"memory_peak_fraction": 0.83, "comm_share": 0.1, "bubble_measured": 0.1}) == {}
    warned = out_of_band({"memory_peak_fraction": 0.95, "comm_share": 0.3, "bubble_measured": 0.2})
    assert "model.remat" in warned["memory_peak_fraction"]
    assert "parallel.tensor" in warned["comm_share"] and "jaxllm.plan --search" in warned["comm_share"]
    assert "parallel.microbatches" in warned["bubble_measured"]
    assert "train.batch_size" in out_of_band({"memory_peak_fraction": 0.3})["memory_peak_fraction"]
    assert out_of_band({}) == {}  # absent (CPU memory): nothing


def test_each_ratio_is_warned_about_once_a_run():
    once = OncePerRun()
    assert len(once.new({"comm_share": 0.3, "memory_peak_fraction": 0.95})) == 2
    assert once.new({"comm_share": 0.4, "memory_peak_fraction": 0.97}) == []  # out again: no second warning
    assert once.new({"bubble_measured": 0.3})[0].startswith("bubble_measured=30.0%")


def test_memory_fractions_come_from_the_backends_stats_only():
    stats = {"bytes_in_use": 40, "peak_bytes_in_use": 90, "bytes_limit": 100}
    assert memory_fractions(stats) == {"memory_fraction": 0.4, "memory_peak_fraction": 0.9}
    assert memory_fractions({}) == {} and memory_fractions({"bytes_in_use": 3}) == {}
    assert jax.local_devices()[0].memory_stats() is None and memory_fractions() == {}  # CPU reports none


@pytest.mark.parametrize(
    "value,expected",
    [("4:3", "1 <= A <= B"), ("0:2", "1 <= A <= B"), ("3", "not a step range"), ("a:b", "not a step range"),
     ("3:200", "ends after train.steps=100")],
)  # fmt: skip
def test_profile_steps_are_checked(value, expected):
    with pytest.raises(ConfigError, match="train.profile_steps") as error:
        TrainConfig(profile_steps=value)
    assert expected in str(error.value)
    assert TrainConfig(profile_steps="3:4").profile_steps == "3:4" and TrainConfig().profile_steps == ""


def test_a_profiled_serving_engine_summarises_its_steps(trained, tmp_path, capsys):
    from jaxllm.serve.generation import Request
    from jaxllm.serve.load import load_engine

    small = {"serve.slots": 1, "serve.max_len": 32, "serve.prefill_chunk": 16, "serve.dtype": "float32"}
    engine = load_engine(trained[0], small)
    engine.profiler = StepProfiler((2, 4), tmp_path)
    engine.generate([Request([1, 2, 3, 4, 5], 8, temperature=0.0, ignore_eos=True)])
    summary = engine.profiler.summary
    assert summary is not None and summary.steps == 3
    assert sum(summary.categories.values()) == pytest.approx(summary.step_time)
    assert (tmp_path / "summary.txt").read_text().startswith("profile: 3 steps")
