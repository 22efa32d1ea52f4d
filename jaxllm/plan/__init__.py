"""The planner: will a config fit, how fast will it run, which layout should it use.

Parameters by component (`params`), FLOPs (`flops`), bytes per device (`memory`), communication
per device (`comm`), an estimated step time and MFU on a named GPU (`estimate`), the bandwidth
bound of a decode step (`decode`), a search over layouts (`search`); `python -m jaxllm.plan --config
configs/120b.py` prints them for any config.
"""

from jaxllm.plan.decode import decode_bytes, decode_limit
from jaxllm.plan.flops import flops_per_token, megatron_flops_per_token
from jaxllm.plan.memory import kv_cache_bytes, layer_activation_bytes, memory, memory_table
from jaxllm.plan.params import applied_matmul_params, param_counts, weight_bytes
from jaxllm.plan.report import summary

__all__ = ["applied_matmul_params", "decode_bytes", "decode_limit", "flops_per_token", "kv_cache_bytes",
           "layer_activation_bytes", "megatron_flops_per_token", "memory", "memory_table", "param_counts", "summary",
           "weight_bytes"]  # fmt: skip
