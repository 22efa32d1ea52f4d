"""Writes a params-only export of a training run for serving and conversion.

    python -m jaxllm.export --workdir runs/tiny --out exports/tiny [--step N]

The export holds `params/` (an Orbax checkpoint of the parameters, groups in canonical order) and
`config.json` (the run's own config, with `export_step`). Only parameters are read from the
checkpoint, sharded over this host's devices; the optimizer state stays on disk.
"""

from __future__ import annotations

import argparse
import pathlib

import ml_collections

from jaxllm.checkpoint import load_params, write_export
from jaxllm.errors import exit_on_error
from jaxllm.parallel.mesh import make_mesh


def export(workdir: str | pathlib.Path, out: str | pathlib.Path, step: int | None = None) -> int:
    """Exports the latest checkpoint (or `step`) of `workdir`; returns its step."""
    fsdp_here = ml_collections.ConfigDict(dict(data=1, fsdp=-1, stage=1, tensor=1))
    cfg, params, step = load_params(workdir, make_mesh(fsdp_here), step=step)
    write_export(out, cfg, params, step)
    print(f"exported step {step} of {workdir} to {pathlib.Path(out).absolute()}")
    return step


@exit_on_error
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxllm.export", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="a training run's --workdir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None, help="a checkpoint step (default: the latest)")
    args = parser.parse_args()
    export(args.workdir, args.out, args.step)


if __name__ == "__main__":
    main()
