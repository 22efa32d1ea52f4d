"""Faults injected into a training run from outside the package, through the loop's `Hooks`: a
poisoned batch (a NaN loss mask makes the step's loss and gradients non-finite), and a SIGKILL
after a step or right after a save starts, as from an OOM killer or a lost node.

    python tests/support/faults.py '{"kill_at_step": 9}' --config configs/tiny.py ...   # the train command, faulty
"""

import dataclasses
import json
import os
import signal
import sys

import jax
import numpy as np

from jaxllm.train.__main__ import main
from jaxllm.train.loop import Hooks


def poisoned(batch: dict) -> dict:
    """`batch` with a loss mask of NaN: the step that trains on it is non-finite."""
    return batch | {"loss_mask": np.full(batch["inputs"].shape, np.nan, np.float32)}


def corrupt_arrays(step_dir) -> None:
    """Overwrites a saved checkpoint step's array files with a few zero bytes: unreadable."""
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * 16)


def alter_one_value(step_dir) -> None:
    """Writes a saved checkpoint step's arrays anew with one number of the embedding changed: the
    files read back whole, with other values (as from a bit flipped on disk that no decoder notices)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    state = jax.tree.map(np.array, checkpointer.restore(step_dir / "state"))
    state["params"]["embed"][(0,) * state["params"]["embed"].ndim] += 1
    checkpointer.save(step_dir / "state", state, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()


def kill_self() -> None:
    print("faults: killing this process with SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass
class FaultPlan(Hooks):
    nan_at_steps: tuple[int, ...] = ()  # steps that train on a poisoned batch
    kill_at_step: int = 0  # SIGKILL after this step, once the earlier saves have landed (0: never)
    kill_during_save: bool = False  # ... right after that step's asynchronous save starts, instead

    def batch(self, step, batch):
        return poisoned(batch) if step in self.nan_at_steps else batch

    def saved(self, step, loop):
        if self.kill_during_save and step == self.kill_at_step:
            kill_self()

    def stepped(self, step, loop):
        if step == self.kill_at_step and not self.kill_during_save:
            loop.checkpoints.wait()  # "between checkpoints": the earlier saves have landed
            kill_self()


if __name__ == "__main__":
    main(sys.argv[2:], hooks=FaultPlan(**json.loads(sys.argv[1])))
