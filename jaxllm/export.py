"""Writes a params-only export of a training run for serving and conversion.

    python -m jaxllm.export --workdir runs/tiny --out exports/tiny [--step N] [--quantize int8]

The export holds `params/` (an Orbax checkpoint of the parameters, groups in canonical order),
`config.json` (the run's own config, with `export_step`) and `tokenizer/` (the run's tokenizer
and its fingerprint). Only parameters are read from the checkpoint, sharded over this host's
devices; the optimizer state stays on disk. With `--quantize int8` the dense projections are
stored int8 with per-output-channel scales (`model.quantize` in its config), and the server
loads them as they are.
"""

from __future__ import annotations

import pathlib

from jaxllm import cli, logs
from jaxllm.checkpoint import load_params, write_export
from jaxllm.config import ParallelConfig
from jaxllm.data.tokenizer import load_saved_tokenizer, save_tokenizer
from jaxllm.errors import exit_on_error
from jaxllm.parallel.mesh import make_mesh

log = logs.get(__name__)


def export(
    workdir: str | pathlib.Path,
    out: str | pathlib.Path,
    step: int | None = None,
    tokenizer: str | None = None,
    quantize: str | None = None,
) -> int:
    """Exports the latest checkpoint (or `step`) of `workdir` with its tokenizer (or `tokenizer`,
    for runs that saved none), its weights quantized if asked; returns its step."""
    saved_tokenizer = load_saved_tokenizer(pathlib.Path(workdir) / "tokenizer", tokenizer)
    cfg, params, step = load_params(workdir, make_mesh(ParallelConfig(data=1, fsdp=-1)), step=step, quantize=quantize)
    write_export(out, cfg, params, step)
    save_tokenizer(saved_tokenizer, pathlib.Path(out) / "tokenizer")
    log.info(f"exported step {step} of {workdir} to {pathlib.Path(out).absolute()}")
    return step


@exit_on_error
def main() -> None:
    parser = cli.parser("python -m jaxllm.export", __doc__)
    parser.add_argument("--workdir", required=True, help="a training run's --workdir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None, help="a checkpoint step (default: the latest)")
    parser.add_argument("--tokenizer", default=None, help="'gpt2' or a tokenizer.json, for runs that saved none")
    parser.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights with per-channel scales")
    args = parser.parse_args()
    export(args.workdir, args.out, args.step, args.tokenizer, args.quantize)


if __name__ == "__main__":
    main()
