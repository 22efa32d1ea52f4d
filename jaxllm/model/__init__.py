"""The decoder: Flax NNX modules over plain parameter dicts."""

from jaxllm.model.decoder import Decoder, LayerGroup, forward, param_specs
from jaxllm.model.params import params_of

__all__ = ["Decoder", "LayerGroup", "forward", "param_specs", "params_of"]
