"""Typed configuration: one frozen, hashable dataclass per section, each checking itself when it is
built (every error names the field, its value and the fix) and deriving what follows from it as
properties; `RunConfig` holds a training run's sections and checks them together; `validate` adds
what depends on the devices.

What users write stays an `ml_collections.ConfigDict` (`configs/*.py`, `--config.x.y=v`, a
checkpoint's stored config): `RunConfig.from_dict` converts it once, at the command line's edge,
and nothing below that edge sees a ConfigDict. `base_config()` is that ConfigDict, made from the
dataclasses' own defaults.
"""

from jaxllm.config.devices import validate, validate_tensor
from jaxllm.config.files import base_config, load_config
from jaxllm.config.schedules import CHUNKED_SCHEDULES, PIPELINE_SCHEDULES, SPLIT_SCHEDULES, TABLE_SCHEDULES, Schedule
from jaxllm.config.section import ConfigError, Section, apply_overrides, field, no_such_field, require
from jaxllm.config.sections import (
    MESH_AXES,
    REMAT_POLICIES,
    CheckpointConfig,
    DataConfig,
    Fp8Config,
    InitConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    RopeScaling,
    RunConfig,
    TrainConfig,
    step_range,
)

__all__ = [
    "CHUNKED_SCHEDULES", "MESH_AXES", "REMAT_POLICIES", "CheckpointConfig", "ConfigError", "DataConfig", "Fp8Config",
    "InitConfig", "LoraConfig", "ModelConfig", "PIPELINE_SCHEDULES", "ParallelConfig", "RopeScaling", "RunConfig",
    "Schedule", "Section", "SPLIT_SCHEDULES", "TABLE_SCHEDULES", "TrainConfig", "apply_overrides", "base_config",
    "field", "load_config", "no_such_field", "require", "step_range", "validate", "validate_tensor",
]  # fmt: skip
