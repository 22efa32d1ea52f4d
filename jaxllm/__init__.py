"""jaxllm: train and serve large decoder-only language models with JAX SPMD sharding."""

__version__ = "0.2.0"
