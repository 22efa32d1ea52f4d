"""Writes a params-only checkpoint for serving from a training run's latest checkpoint.

    python -m jaxllm.export --workdir runs/tiny --out exports/tiny

The output holds `params/` (an Orbax checkpoint of the parameters, groups in canonical order, no
optimizer state) and `config.json` (the run's full config, from which the model is rebuilt).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import ml_collections
import orbax.checkpoint as ocp

from jaxllm.config import validate
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.checkpoint import Checkpointer, saved_config


def export(workdir: str | pathlib.Path, out: str | pathlib.Path) -> int:
    """Exports the latest valid checkpoint of `workdir`; returns its step."""
    cfg = saved_config(workdir)
    # Restore with FSDP over whatever devices are here; the training batch plays no part.
    cfg.parallel.update(data=1, fsdp=-1, stage=1, tensor=1, microbatches=1, repeats=1)
    cfg.train.update(batch_size=jax.device_count(), grad_accum_steps=1)
    validate(cfg, jax.device_count())
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(mesh):
        checkpoints = Checkpointer(workdir, cfg, mesh)
        restored = checkpoints.restore_latest()
        checkpoints.close()
        if restored is None:
            raise SystemExit(f"error: {workdir} has no readable checkpoint to export")
        out = pathlib.Path(out).absolute()
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(out / "params", restored.state["params"], force=True)
        checkpointer.wait_until_finished()
    (out / "config.json").write_text(cfg.to_json_best_effort(indent=2))
    print(f"exported step {restored.step} of {workdir} to {out}")
    return restored.step


def load_exported(path: str | pathlib.Path) -> tuple[ml_collections.ConfigDict, dict]:
    """(config, params) of an export, params on the default device."""
    path = pathlib.Path(path).absolute()
    cfg = ml_collections.ConfigDict(json.loads((path / "config.json").read_text()))
    return cfg, ocp.StandardCheckpointer().restore(path / "params")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxllm.export", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="a training run's --workdir")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    export(args.workdir, args.out)


if __name__ == "__main__":
    main()
