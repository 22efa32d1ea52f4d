"""Lost work after a kill at a random moment, with and without the fast checkpoint tier, side by side
in one run: the same random kill times, each run resumed to its end, lost steps and seconds read from
the run's goodput ledger (`python -m jaxllm.train --goodput WORKDIR`).

    python scripts/bench_lost_work.py [--trials 3] [--steps 60] [--every 20] [--local-every 2] [--seed 0]

Each trial trains the tiny config (shrunk to seconds a step on 8 fake CPU devices) with persistent
saves every `--every` steps; the fast-tier run also saves every `--local-every` steps to a local
directory. A SIGKILL lands at a uniformly random moment between the first logged step and the
expected end, then the same command resumes the run.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.runs import device_env, train_command  # noqa: E402 - the tests' shrunk train command

from jaxllm.train.goodput import account  # noqa: E402


def first_step_time(workdir: pathlib.Path, proc: subprocess.Popen) -> float:
    path = workdir / "metrics.jsonl"
    while not path.exists() or not path.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before its first step (code {proc.returncode})")
        time.sleep(0.05)
    return time.time()


def trial(root: pathlib.Path, name: str, overrides: list[str], kill_after: float) -> dict:
    workdir = root / name
    command = train_command(workdir, *overrides, data_dir=root / "data")
    proc = subprocess.Popen(command, cwd=ROOT, env=device_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(max(first_step_time(workdir, proc) + kill_after - time.time(), 0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run(command, cwd=ROOT, env=device_env(), check=True, capture_output=True)
    return account(workdir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20, help="persistent saves every N steps")
    parser.add_argument("--local-every", type=int, default=2, help="fast-tier saves every N steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    common = [f"--config.train.steps={args.steps}", f"--config.checkpoint.every_steps={args.every}",
              "--config.parallel.data=4", "--config.parallel.fsdp=2", "--config.data.eval_every=1000"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="jaxllm-lost-work-") as tmp:
        root = pathlib.Path(tmp)
        # An uninterrupted run prepares the data and times a step, so kills spread over the run.
        subprocess.run(train_command(root / "base", *common, data_dir=root / "data"), cwd=ROOT, env=device_env(),
                       check=True, capture_output=True)  # fmt: skip
        step_s = account(root / "base")["seconds"]["productive"] / (args.steps - 1)
        rng = random.Random(args.seed)
        kills = [rng.uniform(0, 0.9 * args.steps * step_s) for _ in range(args.trials)]
        tiers = {
            "persistent only": common,
            "with the fast tier": [*common, f"--config.checkpoint.local_dir={root / 'local'}",
                                   f"--config.checkpoint.local_every_steps={args.local_every}"],  # fmt: skip
        }
        print(f"{args.trials} kills at random moments ({', '.join(f'{k:.1f}' for k in kills)} s after the first "
              f"step; a step takes {step_s:.2f} s), persistent saves every {args.every} steps, fast tier every "
              f"{args.local_every}:")  # fmt: skip
        results = {}
        for name, overrides in tiers.items():
            runs = []
            for i, kill in enumerate(kills):
                shutil.rmtree(root / "local", ignore_errors=True)  # each trial's fast tier starts empty
                runs.append(trial(root, f"{name.replace(' ', '-')}-{i}", overrides, kill))
            results[name] = runs
            lost = [r["lost_steps"] for r in runs]
            seconds = [r["seconds"]["lost"] for r in runs]
            print(f"  {name:<20} lost steps {lost} (mean {statistics.mean(lost):.1f}), lost work "
                  f"{statistics.mean(seconds):.2f} s a kill, goodput {statistics.mean(r['goodput'] for r in runs):.1%}")
        base_lost = statistics.mean(r["lost_steps"] for r in results["persistent only"])
        fast_lost = statistics.mean(r["lost_steps"] for r in results["with the fast tier"])
        print(f"lost steps with the fast tier / without: {fast_lost / base_lost if base_lost else float('nan'):.2f}")


if __name__ == "__main__":
    main()
