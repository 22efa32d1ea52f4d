"""Checkpoints: the training state (Orbax, async, sharded, canonical layout) and params-only
restores onto any mesh for serving, export and conversion."""

from jaxllm.checkpoint.manager import Checkpointer, CheckpointError, Restored, saved_config
from jaxllm.checkpoint.params import load_params, stored_config, write_export

__all__ = [
    "CheckpointError", "Checkpointer", "Restored", "load_params", "saved_config", "stored_config", "write_export"
]  # fmt: skip
