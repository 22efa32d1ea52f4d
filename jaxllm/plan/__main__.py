"""`python -m jaxllm.plan --config configs/X.py [--device h100-80gb] [--search --gpus N] [--compile]
[--plot out.png] [--convention megatron] [--serve-batch B --context T]`."""

import math

from absl import app, flags

from jaxllm.cli import CONFIG
from jaxllm.config import MESH_AXES, validate
from jaxllm.errors import exit_on_error
from jaxllm.plan.hardware import ACCELERATORS
from jaxllm.plan.report import (
    activation_report,
    comm_report,
    estimate_report,
    kv_report,
    memory_report,
    search_report,
    summary,
)
from jaxllm.plan.search import HEADROOM, search

DEVICE = flags.DEFINE_enum("device", "h100-80gb", list(ACCELERATORS), "The GPU to fit and time the config on.")
HEADROOM_FLAG = flags.DEFINE_float("headroom", HEADROOM, "Fraction of device memory the fit check leaves free.")
SEARCH = flags.DEFINE_bool("search", False, "Rank the layouts that fit --gpus devices of --device.")
GPUS = flags.DEFINE_integer("gpus", None, "Devices for --search (default: the config's mesh size).")
TOP = flags.DEFINE_integer("top", 15, "Layouts --search prints (the config's own is always shown).")
COMPILE = flags.DEFINE_bool(
    "compile",
    False,
    "Also compile the train step on fake CPU devices and set the "
    "compiler's memory and collectives beside the estimates.",
)
PLOT = flags.DEFINE_string(
    "plot",
    None,
    "Draw memory by component and the pipeline schedule to this PNG "
    "(needs the 'plot' extra: pip install -e '.[plot]').",
)
CONVENTION = flags.DEFINE_enum(
    "convention",
    "ours",
    ["ours", "megatron"],
    "Also count parameters as Megatron-LM's paper does (learned positions, biases).",
)
SERVE_BATCH = flags.DEFINE_integer("serve-batch", 1, "Sequences of the KV-cache estimate.")
CONTEXT = flags.DEFINE_integer("context", None, "Tokens per sequence of the KV-cache estimate (default: max_seq_len).")


@exit_on_error
def main(argv) -> None:
    del argv
    cfg, accelerator = CONFIG.value, ACCELERATORS[DEVICE.value]
    validate(cfg, math.prod(max(cfg.parallel[a], 1) for a in MESH_AXES))
    if COMPILE.value:  # before JAX starts: the compile needs the mesh's devices
        from jaxllm.train.dry_run import ensure_fake_devices

        ensure_fake_devices(cfg, module="jaxllm.plan")
    context = CONTEXT.value or cfg.model.max_seq_len
    sections = [
        summary(cfg, CONVENTION.value).splitlines(),
        memory_report(cfg, accelerator, HEADROOM_FLAG.value),
        activation_report(cfg),
        kv_report(cfg.model, SERVE_BATCH.value, context, max(cfg.parallel.tensor, 1)),
        comm_report(cfg, accelerator),
        estimate_report(cfg),
    ]
    if SEARCH.value:
        gpus = GPUS.value or max(1, cfg.parallel.data) * cfg.parallel.fsdp * cfg.parallel.stage * cfg.parallel.tensor
        fitting, valid = search(cfg, gpus, accelerator, HEADROOM_FLAG.value)
        sections.append(search_report(cfg, fitting, valid, gpus, accelerator, TOP.value))
    print("\n\n".join("\n".join(lines) for lines in sections), flush=True)
    if PLOT.value:
        from jaxllm.plan.plot import plot

        plot(cfg, PLOT.value)
        print(f"\nwrote {PLOT.value}")
    if COMPILE.value:
        from jaxllm.train.dry_run import compare_with_compiler

        print()
        compare_with_compiler(cfg)


if __name__ == "__main__":
    app.run(main)
