"""The planner's text: what `python -m jaxllm.plan`, the trainer and the dry run print."""

from __future__ import annotations

from jaxllm.config import TABLE_SCHEDULES, ModelConfig, RunConfig
from jaxllm.parallel import timetable
from jaxllm.plan.comm import communication
from jaxllm.plan.decode import decode_limit
from jaxllm.plan.estimate import assumptions, estimate, link_bandwidth, seconds
from jaxllm.plan.flops import flops_per_token, megatron_flops_per_token
from jaxllm.plan.hardware import ACCELERATORS, DEFAULT_EFFICIENCY, Accelerator, Efficiency, GiB
from jaxllm.plan.memory import (
    KV_BYTES,
    korthikanti_layer_bytes,
    kv_cache_bytes,
    layer_activation_bytes,
    memory,
    mesh_sizes,
)
from jaxllm.plan.params import applied_matmul_params, megatron_extras, param_counts, weight_bytes
from jaxllm.plan.search import Layout, Searched


def summary(cfg: RunConfig, convention: str = "ours") -> str:
    """Parameters, FLOPs, precision, weight bytes and the pipeline schedule. With convention
    'megatron', also the count with the learned positions and biases of Megatron-LM's formula."""
    model, seq = cfg.model, cfg.train.seq_len
    counts = param_counts(model)
    lines = ["parameters:"]
    lines += [f"  {name:<24}{n:>20,}" for name, n in counts.items()]
    if convention == "megatron":
        extras = megatron_extras(model, seq)
        lines += [f"  + {name:<22}{n:>20,}" for name, n in extras.items()]
        lines.append(
            f"  {'total, Megatron-LM':<24}{counts['total'] + sum(extras.values()):>20,} "
            f"({counts['total'] / 1e9:.2f}B ours, {(counts['total'] + sum(extras.values())) / 1e9:.2f}B theirs)"
        )
    lines.append(f"applied matmul params/token {applied_matmul_params(model):,}")
    ours, megatron = flops_per_token(model, seq), megatron_flops_per_token(model, seq)
    lines.append(
        f"training FLOPs/token        {ours:.4g} (seq {seq}; Megatron-LM's convention, attention "
        f"12·l·h·s: {megatron:.4g})"
    )
    lines.append(f"training FLOPs/step         {ours * cfg.train.batch_size * seq:.4g}")
    precision = f"precision: params {model.param_dtype}, compute {model.dtype}"
    if model.fp8.enabled:
        fp8 = f"e4m3 forward, e5m2 gradients, current scaling, amax {model.fp8.amax_reduce}"
        precision += f"; dense projections FP8 ({fp8})"
    lines.append(precision)
    widths = ", ".join(f"{width} {n / 1e9:.4g}" for width, n in weight_bytes(model).items())
    lines.append(f"weights, GB: {widths}")
    if (schedule := cfg.parallel.pipeline) is not None:
        if schedule.kind in TABLE_SCHEDULES:
            table = timetable.of(schedule)
            loop = f"{table.steps} steps of a forward and a backward, up to {max(table.held)} microbatches held"
        else:
            loop = f"{schedule.iterations} iterations forward, then back"
        lines.append(
            f"pipeline {schedule.kind}: {schedule.stages} stages × {schedule.repeats} chunks, "
            f"{schedule.microbatches} microbatches, {loop}, bubble {timetable.bubble_of(schedule):.1%}"
        )
    return "\n".join(lines)


def _size(n: float) -> str:
    return f"{n / GiB:9.2f} GiB" if n >= GiB else f"{n / 2**20:9.2f} MiB"


def memory_report(cfg: RunConfig, accelerator: Accelerator, headroom: float) -> list[str]:
    planned = memory(cfg)
    lines = ["per-device memory of a train step (mesh sizes of -1 count as 1):"]
    lines += [f"  {name:<46}{_size(n)}" for name, n in planned.items()]
    budget = accelerator.memory * (1 - headroom)
    verdict = "fits" if planned["total"] <= budget else "does NOT fit"
    lines.append(
        f"  {verdict} one {accelerator.label} ({accelerator.memory / GiB:.1f} GiB less {headroom:.0%} "
        f"headroom = {budget / GiB:.1f} GiB): {planned['total'] / accelerator.memory:.0%} of it"
    )
    if cfg.model.lora.rank or cfg.data.format != "text":  # a fine-tuning: the other methods beside it
        lines += [f"  {name}: {memory(other)['total'] / GiB:.2f} GiB" for other, name in _other_fine_tunings(cfg)]
    return lines


def _other_fine_tunings(cfg: RunConfig) -> list[tuple[RunConfig, str]]:
    """Of full fine-tuning (fp32 master weights) and LoRA (the config's adapters, else rank 16 on
    every projection) on a base frozen in bf16 or in int8, those the config is not."""
    m = cfg.model
    lora = m.lora.to_dict() if m.lora.rank else dict(rank=16, alpha=32.0, targets="q,k,v,o,gate,up,down")
    lora_on, full = f"LoRA instead, rank {lora['rank']}, base frozen in", dict(rank=0)
    methods = {
        "full": (dict(lora=full, param_dtype="float32", quantize=None), "full fine-tuning instead, fp32 weights"),
        "bf16": (dict(lora=lora, param_dtype="bfloat16", quantize=None), f"{lora_on} bf16"),
        "int8": (dict(lora=lora, param_dtype="bfloat16", quantize="int8"), f"{lora_on} int8"),
    }
    own = "full" if not m.lora.rank else "int8" if m.quantize else "bf16" if m.param_dtype == "bfloat16" else None
    return [(cfg.updated(model=model), name) for key, (model, name) in methods.items() if key != own]


def activation_report(cfg: RunConfig) -> list[str]:
    """One layer's kept activations per sequence on one device, by remat policy, beside
    Korthikanti et al. 2022's formula."""
    m, p, seq = cfg.model, cfg.parallel, cfg.train.seq_len
    tensor = max(p.tensor, 1)
    ours = layer_activation_bytes(m, seq, 1, tensor, p.sequence_parallel)
    sp = ", sequence parallel" if p.sequence_parallel else ""
    lines = [
        f"activations one layer keeps for the backward pass, per sequence of {seq} on one device (tensor {tensor}{sp}):"
    ]
    lines += [f"  remat {policy:<40}{_size(n)}" for policy, n in ours.items()]
    theirs = korthikanti_layer_bytes(m, seq, 1)
    lines.append(
        f"  Korthikanti et al. 2022, s·b·h·(34 + 5·a·s/h), 16-bit, no parallelism: {_size(theirs).strip()}"
        f"; ÷ tensor with sequence parallelism: {_size(theirs / tensor).strip()}"
    )
    lines.append(
        "    (their layer: GELU MLP 4h, dropout masks, attention scores and softmax kept; ours: no dropout,"
        " GLU, scores only under model.attention='xla')"
    )
    return lines


def serving_report(model: ModelConfig, batch: int, context: int, tensor: int, accelerator: Accelerator) -> list[str]:
    cells = ", ".join(
        f"{dtype} {_size(kv_cache_bytes(model, batch, context, dtype, tensor)).strip()}" for dtype in KV_BYTES
    )
    limits = ", ".join(
        f"{n} sequence(s) {decode_limit(model, n, context, accelerator.hbm):,.0f}" for n in sorted({1, batch})
    )
    return [
        f"KV cache for {batch} sequence(s) × {context} tokens, per device over tensor {tensor}: {cells}",
        f"decode at most, tokens/s on one {accelerator.label} ({accelerator.hbm / 1e12:.3g} TB/s, bf16 weights and "
        f"cache read once a step, {context} tokens): {limits}",
    ]


def comm_report(cfg: RunConfig, accelerator: Accelerator, efficiency: Efficiency = DEFAULT_EFFICIENCY) -> list[str]:
    sizes = mesh_sizes(cfg)
    lines = [f"communication per device per step (array × runs; bytes sent by a ring; time on {accelerator.label}):"]
    sent = {}  # bytes sent per mesh-axis group, and over which link
    for x in communication(cfg):
        lines.append(
            f"  {x.what:<62}{x.op:<19}{'×'.join(x.axes):<18}{x.array / 1e9:10.4f} GB × {x.count:<6g}"
            f"{x.wire_bytes(sizes) / 1e9:10.3f} GB {seconds(x, sizes, accelerator, efficiency) * 1e3:9.2f} ms"
        )
        link = "NVLink" if link_bandwidth(x.axes, sizes, accelerator) == accelerator.nvlink else "network"
        key = ("×".join(x.axes), link)
        sent[key] = sent.get(key, 0.0) + x.wire_bytes(sizes)
    lines.append(
        "  sent per device per step: "
        + ", ".join(f"{axes} {n / 1e9:.1f} GB ({link})" for (axes, link), n in sent.items())
    )
    return lines


def estimate_report(cfg: RunConfig, efficiency: Efficiency = DEFAULT_EFFICIENCY) -> list[str]:
    t = cfg.train
    lines = ["estimated step (compute incl. bubble | tensor+stage transfers | data+fsdp transfers, overlapped):"]
    for name, accelerator in ACCELERATORS.items():
        e = estimate(cfg, accelerator, efficiency)
        tokens = t.batch_size * t.seq_len / e.step
        lines.append(
            f"  {name:<11}{e.compute:9.3f} s |{e.exposed:9.3f} s |{e.overlapped:9.3f} s  → step {e.step:8.3f} s, "
            f"{tokens:12,.0f} tokens/s, MFU {e.mfu:.1%}"
        )
    lines += ["  assuming:"] + [f"    {a}" for a in assumptions(efficiency)]
    return lines


def search_report(cfg, searched: Searched, gpus: int, accelerator: Accelerator, top: int) -> list[str]:
    fitting = searched.fitting
    lines = [
        f"layouts for {gpus} × {accelerator.label}: {searched.valid} pass the config's checks, {len(fitting)} fit; "
        f"fastest first (estimated):"
    ]
    if not searched.valid:  # say why, most common first
        lines += [f"  {n} refused: {message}" for message, n in searched.refused.most_common(3)]
    own = Layout.of(cfg)
    for rank, c in enumerate(fitting, 1):
        if rank <= top or c.layout == own:
            mark = "  ← this config" if c.layout == own else ""
            lines.append(
                f"  {rank:4d}. step {c.estimate.step:7.3f} s, MFU {c.estimate.mfu:5.1%}, {c.memory / GiB:6.1f} GiB"
                f"  {c.layout.overrides()}{mark}"
            )
    if own not in [c.layout for c in fitting]:
        lines.append(f"  this config's layout is not among them: {own.overrides()}")
    return lines
