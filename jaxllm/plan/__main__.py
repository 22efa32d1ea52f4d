"""`python -m jaxllm.plan --config configs/X.py [--config.a.b=value ...] [--device h100-80gb]
[--search --gpus N] [--compile] [--plot out.png] [--convention megatron] [--serve-batch B --context T]
[--efficiency FIT.json]`; `--sweep --gpus N [--fit FIT.json]` measures the best layouts instead."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

from jaxllm import cli
from jaxllm.config import RunConfig, load_config, validate
from jaxllm.errors import exit_on_error
from jaxllm.plan import fit, sweep
from jaxllm.plan.hardware import ACCELERATORS, DEFAULT_EFFICIENCY, GiB
from jaxllm.plan.report import (
    activation_report,
    comm_report,
    estimate_report,
    memory_report,
    search_report,
    serving_report,
    summary,
)
from jaxllm.plan.search import HEADROOM, search


@exit_on_error
def main(argv: list[str] | None = None) -> None:
    parser = cli.parser("python -m jaxllm.plan", __doc__, [RunConfig])
    parser.add_argument("--config", required=True, help="a config file (configs/*.py)")
    parser.add_argument("--device", default="h100-80gb", choices=list(ACCELERATORS), help="the GPU to fit and time on")
    parser.add_argument("--headroom", type=float, default=HEADROOM, help="fraction of memory the fit check leaves")
    parser.add_argument("--search", action="store_true", help="rank the layouts that fit --gpus devices of --device")
    parser.add_argument("--gpus", type=int, help="devices for --search (default: the config's mesh size)")
    parser.add_argument("--top", type=int, default=15, help="layouts --search prints (the config's own always)")
    parser.add_argument("--compile", action="store_true", help="also run `python -m jaxllm.train --dry-run`: the "
                        "compiler's memory and collectives beside the estimates")  # fmt: skip
    parser.add_argument("--plot", help="draw memory by component and the schedule to this PNG (the 'plot' extra)")
    parser.add_argument("--convention", default="ours", choices=["ours", "megatron"],
                        help="also count parameters as Megatron-LM's paper does")  # fmt: skip
    parser.add_argument("--serve-batch", type=int, default=1, help="sequences of the KV-cache estimate")
    parser.add_argument(
        "--context", type=int, help="tokens per sequence of the KV-cache estimate (default: max_seq_len)"
    )
    parser.add_argument("--efficiency", help="a JSON that --fit wrote: its fitted matmul and link efficiencies "
                        "in place of the defaults")  # fmt: skip
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="train a few steps of each of the best --top-sweep "
        "layouts and the hand layouts of a node on the devices present; planned against measured",
    )
    parser.add_argument("--top-sweep", type=int, default=3, help="the planner's fastest layouts --sweep measures")
    parser.add_argument("--sweep-steps", type=int, default=5, help="steps of each --sweep run (the last 2 profiled)")
    parser.add_argument("--sweep-dir", help="where --sweep runs (default: runs/sweep-<config name>)")
    parser.add_argument(
        "--microbatches",
        default=",".join(map(str, sweep.MICROBATCHES)),
        help="the hand pipelines' microbatch counts in --sweep, as multiples of their stages",
    )
    parser.add_argument("--fit", help="with --sweep: fit the efficiencies to the measured table, write them and "
                        "the table to this JSON")  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    rest, texts = cli.split_overrides(argv)
    args = parser.parse_args(rest)
    cfg, accelerator = load_config(args.config, cli.typed_overrides(texts)), ACCELERATORS[args.device]
    sizes = cfg.parallel.sizes
    validate(cfg, math.prod(max(s, 1) for s in sizes.values()))
    efficiency = fit.load(args.efficiency) if args.efficiency else DEFAULT_EFFICIENCY
    if args.fit and not args.sweep:
        parser.error("--fit fits a sweep's measurements: add --sweep")
    if args.sweep:
        gpus = args.gpus or math.prod(max(s, 1) for s in sizes.values())
        run_sweep(args, texts, cfg, gpus, efficiency)
        return
    context = args.context or cfg.model.max_seq_len
    sections = [
        summary(cfg, args.convention).splitlines(),
        memory_report(cfg, accelerator, args.headroom),
        activation_report(cfg),
        serving_report(cfg.model, args.serve_batch, context, max(sizes["tensor"], 1), accelerator),
        comm_report(cfg, accelerator, efficiency),
        estimate_report(cfg, efficiency),
    ]
    if args.search:
        gpus = args.gpus or math.prod(max(s, 1) for s in sizes.values())
        searched = search(cfg, gpus, accelerator, args.headroom, efficiency)
        sections.append(search_report(cfg, searched, gpus, accelerator, args.top))
        if searched.valid and not searched.fitting:  # the checks passed some, memory none
            sections.append(fewest_gpus_report(cfg, gpus, accelerator, args.headroom, efficiency))
    print("\n\n".join("\n".join(lines) for lines in sections), flush=True)
    if args.plot:
        from jaxllm.plan.plot import plot

        plot(cfg, args.plot)
        print(f"\nwrote {args.plot}")
    if args.compile:  # the training stack compiles the real step, in a process of its own
        command = [sys.executable, "-m", "jaxllm.train", "--config", args.config, *(f"--config.{k}={v}" for k, v in
                   texts.items()), "--dry-run"]  # fmt: skip
        print(f"\n$ {' '.join(command[1:])}", flush=True)
        if subprocess.run(command).returncode:
            sys.exit("error: the dry run failed; see above")


def fewest_gpus_report(cfg, gpus: int, accelerator, headroom: float, efficiency, most: int = 4096) -> list[str]:
    """When nothing fits `gpus`: the smallest power-of-two multiple of it where something does."""
    budget = f"{accelerator.memory * (1 - headroom) / GiB:.1f} GiB"
    more = gpus * 2
    while more <= most:
        if fitting := search(cfg, more, accelerator, headroom, efficiency).fitting:
            best = fitting[0]
            return [f"none fits {budget} a device on {gpus} GPUs; on {more}, {len(fitting)} do, the fastest at "
                    f"{best.memory / GiB:.1f} GiB: {best.layout.overrides()}"]  # fmt: skip
        more *= 2
    return [f"none fits {budget} a device on {gpus} to {most} GPUs: a smaller model, remat, or a larger device"]


def run_sweep(args, texts: dict[str, str], cfg, gpus: int, efficiency) -> None:
    """`--sweep`: plan the layouts, measure each, print the table; with `--fit`, fit and write."""
    accelerator = ACCELERATORS[args.device]
    multiples = [int(m) for m in args.microbatches.split(",") if m.strip()]
    rows = sweep.plan_rows(cfg, gpus, accelerator, args.top_sweep, efficiency, args.headroom, multiples)
    workdir = pathlib.Path(args.sweep_dir or f"runs/sweep-{pathlib.Path(args.config).stem}")
    sweep.measure(rows, args.config, texts, args.sweep_steps, workdir, log=lambda s: print(s, flush=True))
    print("\n".join(sweep.table(rows, accelerator)), flush=True)
    if args.fit:
        fitted, error = fit.fit(sweep.fit_rows(rows), efficiency)
        measured = next((r.measured for r in rows if r.measured), {})
        about = {"config": args.config, "overrides": texts, "gpus": gpus, "planned_for": args.device,
                 "backend": measured.get("backend"), "device_kind": measured.get("device_kind"),
                 "steps": args.sweep_steps}  # fmt: skip
        fit.save(args.fit, fitted, error, [r.as_dict() for r in rows], about)
        print(
            f"fitted on {about['backend']} against {accelerator.label}'s peaks: matmul efficiency "
            f"{fitted.matmul:.4g}, link efficiency {fitted.link:.4g} (rms error {error:.1%}); wrote {args.fit}"
        )


if __name__ == "__main__":
    main()
