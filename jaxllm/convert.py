"""Converts Llama-family models between Hugging Face directories and jaxllm.

    python -m jaxllm.convert from-hf --hf DIR --out EXPORT
    python -m jaxllm.convert to-hf --checkpoint EXPORT_OR_RUN --out DIR [--dtype bfloat16] [--expand-shared-qkv]
    python -m jaxllm.convert to-hf --checkpoint LORA_RUN --out DIR --peft

`from-hf` writes an export (`serve --checkpoint EXPORT` serves it; it keeps the weights' dtype and
the tokenizer's files). `to-hf` writes config.json, safetensors (sharded past --max-shard-size,
with the index), generation_config.json and the tokenizer's files, as transformers, vLLM and TGI
load them. A model Llama cannot express is refused by the field that differs; a shared QKV
(`qkv_share_every` > 1) is written into every layer of its group with --expand-shared-qkv. A LoRA
run converts merged (each adapter folded into its weight), or with --peft as a PEFT adapter
directory for the Llama it started from.
Both directions go a tensor at a time (see `jaxllm/checkpoint/hf/`); neither needs torch.
"""

from __future__ import annotations

import argparse
import pathlib
import re

from jaxllm import cli, logs
from jaxllm.checkpoint import load_params, stored_config, write_export
from jaxllm.checkpoint.hf.config import ConversionError, check_llama, is_hf_dir, require_hf_dir
from jaxllm.checkpoint.hf.directory import expanded_qkv_parameters, write_hf
from jaxllm.checkpoint.hf.files import SAFETENSORS_DTYPES
from jaxllm.checkpoint.hf.peft import write_peft
from jaxllm.config import LoraConfig, ParallelConfig
from jaxllm.data.tokenizer import HFTokenizer, has_saved_tokenizer, load_saved_tokenizer, save_tokenizer
from jaxllm.errors import exit_on_error
from jaxllm.model.decoder import Model
from jaxllm.model.int8 import contracted_dims, dequantize
from jaxllm.model.lora import adapter_path, fold, has_adapter
from jaxllm.model.params import at_path, count
from jaxllm.parallel.mesh import make_mesh

log = logs.get(__name__)

UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _local_fsdp_mesh():
    """Params split over this host's devices, so no one device holds a whole large model."""
    return make_mesh(ParallelConfig(data=1, fsdp=-1))


def from_hf(hf: str | pathlib.Path, out: str | pathlib.Path) -> None:
    hf, out = require_hf_dir(hf, "--hf"), _empty_out(out)
    cfg, params, _ = load_params(hf, _local_fsdp_mesh())
    write_export(out, cfg, params, 0)
    if (hf / "tokenizer.json").is_file():
        save_tokenizer(HFTokenizer(hf), out / "tokenizer")
        tokenizer = "with its tokenizer"
    else:
        tokenizer = "without a tokenizer (none in the directory: pass --tokenizer when serving)"
    log.info(f"from-hf: {hf} → {out.absolute()}: {count(Model(cfg.model).specs):,} parameters (vocab padded to "
             f"{cfg.model.padded_vocab}) in {cfg.model.param_dtype}, {tokenizer}")  # fmt: skip


def to_hf(
    checkpoint: str | pathlib.Path,
    out: str | pathlib.Path,
    dtype: str | None = None,
    expand_shared_qkv: bool = False,
    max_shard_bytes: int = 5 * 10**9,
    tokenizer: str | None = None,
    peft: bool = False,
) -> None:
    checkpoint, out = pathlib.Path(checkpoint), _empty_out(out)
    if is_hf_dir(checkpoint):
        raise ConversionError(f"--checkpoint {checkpoint} is already a Hugging Face directory; to change its dtype or "
                              "shards, convert it from-hf first, then to-hf")  # fmt: skip
    stored = stored_config(checkpoint)
    model, specs = stored.model, Model(stored.model).specs
    check_llama(model, expand_shared_qkv)  # before reading any weights
    mesh, read = _local_fsdp_mesh(), {}

    def parameter(path: tuple[str, ...]):  # one at a time: host memory holds one, not the model
        # Every parameter from the step the first one came from (a run's latest readable checkpoint).
        _, params, read["step"] = load_params(checkpoint, mesh, step=read.get("step"), only=path)
        return at_path(params, path)

    if peft:
        if not model.lora.rank:
            raise ConversionError(f"--peft: {checkpoint} has no LoRA adapters (model.lora.rank=0); convert it "
                                  "without --peft")  # fmt: skip
        write_peft(out, model, parameter, stored.init.hf, dtype or "float32")
        log.info(f"to-hf: the rank-{model.lora.rank} adapters of step {read['step']} of {checkpoint} → "
                 f"{out.absolute()} (PEFT, for the base model {stored.init.hf or 'it started from'})")  # fmt: skip
        return

    def merged(path: tuple[str, ...]):  # a weight with its adapter folded in; an int8 base's dequantized
        weight = parameter(path)
        if has_adapter(specs, path):
            return fold(weight, parameter(adapter_path(path)), stored.model.lora.scale)
        return dequantize(weight, contracted_dims(at_path(specs, path))) if isinstance(weight, dict) else weight

    saved = checkpoint / "tokenizer"
    saved_tokenizer = load_saved_tokenizer(saved, tokenizer) if tokenizer or has_saved_tokenizer(saved) else None
    model, dtype = model.replace(lora=LoraConfig(), quantize=None), dtype or model.param_dtype
    files = write_hf(out, model, merged, saved_tokenizer, dtype, max_shard_bytes)
    log.info(f"to-hf: step {read['step']} of {checkpoint} → {out.absolute()}: {len(files)} safetensors file(s) in "
             f"{dtype}")  # fmt: skip
    if model.qkv_share_every > 1:
        log.info(f"to-hf: --expand-shared-qkv wrote each of the {model.groups} shared q/k/v into the "
                 f"{model.qkv_share_every} layers of its group: an exact Llama with "
                 f"{expanded_qkv_parameters(model):,} more parameters than this model")  # fmt: skip
    if saved_tokenizer is None:
        log.warning(f"to-hf: {checkpoint} holds no tokenizer, so {out} has none (and config.json names no bos "
                    "or eos token): copy the model's tokenizer files there, or convert again with --tokenizer")
    elif not isinstance(saved_tokenizer, HFTokenizer):
        log.warning(f"to-hf: the run's tokenizer is {saved_tokenizer.name!r}, which has no tokenizer.json; load it "
                    "with transformers' AutoTokenizer.from_pretrained('gpt2')")  # fmt: skip


def _empty_out(out: str | pathlib.Path) -> pathlib.Path:
    """`out`, refused if it holds anything: files of an earlier conversion would mix with these."""
    out = pathlib.Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"--out {out} is not empty; pass a new directory (or empty this one)")
    return out


def byte_size(text: str) -> int:
    """'5GB', '500MB' or a count of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", text.upper())
    if not match or match[2] not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MB or 1000000")
    return int(match[1]) * UNITS[match[2]]


@exit_on_error
def main() -> None:
    parser = cli.parser("python -m jaxllm.convert", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    down = sub.add_parser("from-hf", help="a Hugging Face Llama directory → a jaxllm export")
    down.add_argument("--hf", required=True, help="a directory with config.json and safetensors")
    down.add_argument("--out", required=True, help="the export directory to write")
    up = sub.add_parser("to-hf", help="a jaxllm export or training run → a Hugging Face Llama directory")
    up.add_argument("--checkpoint", required=True, help="an export, or a training run's --workdir (its latest step)")
    up.add_argument("--out", required=True)
    up.add_argument("--dtype", choices=sorted(SAFETENSORS_DTYPES), default=None,
                    help="of the written weights (default: as stored)")  # fmt: skip
    up.add_argument("--expand-shared-qkv", action="store_true",
                    help="write each group's shared q/k/v into every layer of the group")  # fmt: skip
    up.add_argument("--max-shard-size", type=byte_size, default="5GB", help="per safetensors file (default 5GB)")
    up.add_argument("--tokenizer", default=None, help="'gpt2' or a tokenizer.json, for runs that saved none")
    up.add_argument("--peft", action="store_true", help="a LoRA run's adapters alone, as a PEFT adapter directory")
    args = parser.parse_args()
    if args.command == "from-hf":
        from_hf(args.hf, args.out)
    else:
        to_hf(args.checkpoint, args.out, args.dtype, args.expand_shared_qkv, args.max_shard_size, args.tokenizer,
              args.peft)  # fmt: skip


if __name__ == "__main__":
    main()
