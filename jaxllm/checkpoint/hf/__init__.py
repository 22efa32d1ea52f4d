"""Hugging Face Llama checkpoints in and out: `config` (config.json ↔ config.model), `tensors` (the
name table), `files` (safetensors) and `directory` (a whole model directory)."""
