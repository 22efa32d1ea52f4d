"""Shared command-line flags: `--config configs/X.py` with dotted overrides (`--config.train.steps=50`)."""

import logging

from absl import flags
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
flags.mark_flag_as_required("config")

# JAX probes for every backend at start-up and logs each miss at INFO; only real problems matter here.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
