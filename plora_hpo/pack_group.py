"""The processes that train one pack together by tensor parallelism (``pack.degree`` > 1).

A group of ``degree`` worker processes, one per device, splits one base replica
(:func:`~plora_hpo.engine.tensor_parallel.shard_model`) and trains each pack on all of them.
Rank 0 of the group is its *leader*: a worker like any other that alone talks to Optuna, the
trial pool, MLflow and the run directory. The other ranks are *followers*: they hold their part
of the model, the same task data and evaluation tasks, and make every engine call the leader's
pack makes, in the same order (each such call is a collective). The leader sends each call over
a :class:`PackChannel` before making it; decisions taken from timing or Optuna (admission,
pruning, checkpoint pacing) are thereby taken once, on the leader.

A group forms the way ``torchrun`` sets processes up: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` in each process's environment (:func:`group_environment` for the sweep's
own worker processes); gloo on the CPU, NCCL on GPUs.

Boundary: forming the group and carrying calls from the leader to the followers; what the
calls do is the worker's (:mod:`plora_hpo.worker`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plora_hpo.errors import ConfigError
from plora_hpo.trials import TrialInterrupted

IDLE_TIMEOUT = timedelta(days=7)
"""How long a follower waits for the leader's next call (the leader may wait that long for
trials); a leader that dies ends the wait at once (its connections close)."""
STOP = "stop"
"""The call that ends a follower: the leader's worker is done."""


class GroupFailed(TrialInterrupted):
    """A pack's tensor-parallel group failed (a rank died or ran out of memory): its trials go
    back to the study and resume from their last checkpoints; the group's leader stops."""


def group_environment(rank: int, degree: int, port: int) -> dict[str, str]:
    """What a process of a local group needs in its environment (as ``torchrun`` sets it)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(degree),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


class PackChannel:
    """The leader's engine calls, broadcast to the group's followers.

    Every rank holds one; rank 0 sends (:meth:`send`), the others :meth:`receive` in the same order.
    """

    def __init__(self, device: torch.device) -> None:
        self.rank = dist.get_rank()
        self.degree = dist.get_world_size()
        self.device = device
        self._stopped = False

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def send(self, name: str, args: tuple[Any, ...]) -> None:
        """Tell the followers to make engine call ``name`` with ``args`` (picklable; tensors are
        sent to host memory first)."""
        assert self.leads, "only the leader sends"
        dist.broadcast_object_list([(name, args)], src=0, device=self._object_device)

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        """The leader's next call (blocks until it sends one)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, device=self._object_device)
        return box[0]

    def stop(self) -> None:
        """Tell the followers that the leader is done (once; later calls do nothing)."""
        if not self._stopped:
            self._stopped = True
            self.send(STOP, ())

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None


def join_group(degree: int, device: torch.device) -> PackChannel | None:
    """Join this process's tensor-parallel group (None for ``degree`` 1).

    Raises a one-line :class:`~plora_hpo.errors.ConfigError` when the environment describes no
    group of ``degree`` processes.
    """
    if degree == 1:
        return None
    size = os.environ.get("WORLD_SIZE")
    if size != str(degree) or "RANK" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ConfigError(
            f"pack.degree {degree} trains each pack on a group of {degree} processes, but this process's "
            f"environment has WORLD_SIZE={size}; start the group with `torchrun --nproc-per-node {degree} "
            f"-m plora_hpo.cli worker ...` (or let `plora-hpo sweep` start it)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", timeout=IDLE_TIMEOUT)
    return PackChannel(device)
