"""`python -m jaxllm.train --config configs/X.py [--config.a.b=value ...] [--workdir DIR]`."""

import pathlib
import sys

from absl import app, flags

from jaxllm.cli import CONFIG
from jaxllm.config import ConfigError
from jaxllm.parallel.distributed import initialize_from_environment
from jaxllm.train.loop import train

WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")


def main(argv) -> None:
    del argv
    initialize_from_environment()
    workdir = WORKDIR.value or f"runs/{pathlib.Path(flags.FLAGS['config'].config_filename).stem}"
    try:
        train(CONFIG.value, workdir)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


if __name__ == "__main__":
    app.run(main)
