"""Which GPUs a SLURM task joins JAX with: JAX alone gives every task the GPU of its SLURM_LOCALID,
which leaves a node's only task (the batch script's default layout) with one GPU of eight."""

import pytest

from jaxllm.parallel.distributed import slurm_local_devices, tasks_per_node


@pytest.mark.parametrize(
    "text, counts", [("1(x8)", [1] * 8), ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("8,1(x2)", [8, 1, 1])]
)
def test_tasks_per_node_reads_slurms_compressed_counts(text, counts):
    assert tasks_per_node(text) == counts


EIGHT = "0,1,2,3,4,5,6,7"


@pytest.mark.parametrize("environ, devices", [
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x8)", "SLURM_NODEID": "5", "CUDA_VISIBLE_DEVICES": EIGHT}, list(range(8))),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x8)", "SLURM_NODEID": "5", "CUDA_VISIBLE_DEVICES": EIGHT}, None),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3", "CUDA_VISIBLE_DEVICES": "4,5"}, [0, 1]),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "4,5"}, None),
    ({"SLURM_TASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, [0, 1, 2, 3]),  # outside a step: the job's
])  # fmt: skip
def test_a_nodes_only_task_takes_every_gpu_and_shared_nodes_leave_it_to_jax(environ, devices):
    assert slurm_local_devices(environ) == devices

