"""`python -m jaxllm.train --config configs/X.py [--config.a.b=value ...] [--workdir DIR]`."""

import pathlib
import sys

from absl import app, flags, logging

from jaxllm.cli import CONFIG
from jaxllm.config import ConfigError
from jaxllm.data.corpus import CorpusError
from jaxllm.data.loader import DataError
from jaxllm.data.tokenizer import TokenizerError
from jaxllm.parallel.distributed import initialize_from_environment
from jaxllm.train.dry_run import dry_run, ensure_fake_devices
from jaxllm.train.loop import train

WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")
DRY_RUN = flags.DEFINE_bool("dry-run", False, "Compile the train step on fake CPU devices for the mesh, report, exit.")


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
    try:
        if DRY_RUN.value:
            ensure_fake_devices(CONFIG.value)
            dry_run(CONFIG.value)
            return
        initialize_from_environment()
        train(CONFIG.value, WORKDIR.value or f"runs/{pathlib.Path(flags.FLAGS['config'].config_filename).stem}")
    except (ConfigError, CorpusError, DataError, TokenizerError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    app.run(main)
