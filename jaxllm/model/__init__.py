"""The decoder: Flax NNX modules over plain parameter dicts."""

from jaxllm.model.decoder import Decoder, LayerGroup, Model
from jaxllm.model.params import params_of

__all__ = ["Decoder", "LayerGroup", "Model", "params_of"]
