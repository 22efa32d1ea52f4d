"""The named device mesh ('data', 'fsdp', 'stage', 'tensor')."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxllm.config import MESH_AXES, ParallelConfig


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    """Builds the mesh from `config.parallel`; sizes are checked against the device count."""
    devices = jax.devices() if devices is None else devices
    shape = parallel.mesh_shape(len(devices))
    if devices == jax.devices():
        # make_mesh orders devices for the physical topology (NVLink/ICI locality for 'tensor').
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    sizes = " × ".join(f"{name} {size}" for name, size in mesh.shape.items())
    return f"mesh: {sizes} = {mesh.size} {mesh.devices.flat[0].platform} devices"
