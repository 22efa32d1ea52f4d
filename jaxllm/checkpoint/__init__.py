"""All weights in and out: the training state (Orbax, async, sharded, canonical layout), params-only
restores onto any mesh for serving, export, conversion and fine-tuning, exports, Hugging Face
safetensors (`hf`) and int8 quantization at load."""

from jaxllm.checkpoint.manager import Checkpointer, CheckpointError, Restored, saved_config
from jaxllm.checkpoint.params import load_params, quantize_params, read_into, stored_config, write_export

__all__ = [
    "CheckpointError", "Checkpointer", "Restored", "load_params", "quantize_params", "read_into", "saved_config",
    "stored_config", "write_export",
]  # fmt: skip
