"""`python -m jaxllm.train --config configs/X.py [--config.a.b=value ...] [--workdir DIR]`; with
`--config.init.hf=DIR`, fine-tunes the Hugging Face Llama there (see `jaxllm/hf/config.py`)."""

import pathlib

from absl import app, flags, logging
from ml_collections import config_flags

from jaxllm.cli import CONFIG
from jaxllm.errors import exit_on_error
from jaxllm.hf.config import fine_tuning_config
from jaxllm.parallel.distributed import initialize_from_environment
from jaxllm.train.dry_run import dry_run, ensure_fake_devices
from jaxllm.train.loop import train

WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")
DRY_RUN = flags.DEFINE_bool("dry-run", False, "Compile the train step on fake CPU devices for the mesh, report, exit.")


@exit_on_error
def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
    cfg = CONFIG.value
    if cfg.init.hf:
        cfg = fine_tuning_config(cfg, config_flags.get_override_values(flags.FLAGS["config"]))
    if DRY_RUN.value:
        ensure_fake_devices(cfg)
        dry_run(cfg)
        return
    initialize_from_environment()
    train(cfg, WORKDIR.value or f"runs/{pathlib.Path(flags.FLAGS['config'].config_filename).stem}")


if __name__ == "__main__":
    app.run(main)
