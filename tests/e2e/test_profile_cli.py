"""`--config.train.profile_steps`: a pipeline run (1F1B, whose loop's steps the run tells the
profiler) traces steps 3 and 4 into WORKDIR/profile/, prints the summary and the out-of-band
warnings once, and logs the measured ratios to metrics.jsonl.
`serve --profile-steps`: the engine's steps traced and summarised the same way."""

import sys

from support.runs import metrics, run, train_command


def test_a_profiled_run_writes_the_trace_and_prints_and_logs_the_summary(tmp_path):
    workdir = tmp_path / "run"
    flags = ["--config.model.qkv_share_every=2", "--config.parallel.stage=2", "--config.parallel.microbatches=2",
             "--config.parallel.schedule=1f1b", "--config.parallel.data=4", "--config.train.steps=5",
             "--config.train.profile_steps=3:4"]  # fmt: skip
    out = run(train_command(workdir, *flags)).stdout
    traces = list((workdir / "profile" / "plugins" / "profile").glob("*/*.trace.json.gz"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert "profile: 2 steps on 8 devices" in out
    for line in ("device time by category", "collective-permute", "top 15 ops", "communication share",
                 "pipeline bubble (measured)"):  # fmt: skip
        assert line in out, out[-3000:]
    assert (workdir / "profile" / "summary.txt").read_text() in out
    logged = {m["step"]: m for m in metrics(workdir)}
    assert {"comm_share", "bubble_measured", "profile_step_time_s", "profile_matmul_s"} <= logged[4].keys()
    assert "comm_share" not in logged[2] and "memory_fraction" not in logged[4]  # CPU reports no memory stats
    # 2 stages × 2 microbatches: a third of the pipeline's time or more is bubble, over the 15 % band
    assert out.count("warning: bubble_measured=") == 1 and "parallel.microbatches" in out
    # One more step in the same workdir resumes after step 5: the run says why it traces nothing.
    again = run(train_command(workdir, *flags[:-2], "--config.train.steps=6", flags[-1])).stdout
    assert "warning: train.profile_steps=3:4 starts at or before step 5, where this run resumes" in again, again
    assert "profile:" not in again and len(list((workdir / "profile" / "plugins" / "profile").glob("*"))) == 1


def test_serve_profile_steps_trace_the_engine_steps(trained, tmp_path):
    serve = [sys.executable, "-m", "jaxllm.serve", "--workdir", str(trained[0]), "--prompt", "def ",
             "--max-tokens", "8", "--config.serve.max_len=64", "--config.serve.slots=2", "--config.serve.tensor=2",
             "--profile-steps", "2:4", "--profile-dir", str(tmp_path / "profile")]  # fmt: skip
    out = run(serve).stdout
    traces = list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.trace.json.gz"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert "profile: 3 steps on 2 devices" in out, out[-3000:]
    assert "device time by category" in out and "all-reduce" in out  # tensor parallel's sums
    assert (tmp_path / "profile" / "summary.txt").read_text() in out
    assert "--- 'def ' (" in out  # the prompt's completion is still printed
