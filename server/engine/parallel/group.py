"""The tensor-parallel process group: torch.distributed set up from torchrun's environment variables.

NCCL carries the layers' all-reduces on CUDA, gloo on CPU. The step commands from rank 0 are Python
objects, so they always travel over a gloo group (CPU tensors), also when the layers use NCCL.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits this long for a peer fails instead of hanging (a peer that died without
# closing its sockets, e.g. a node that vanished).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group; size 1 = no group, every collective is the identity."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
_control: dist.ProcessGroup | None = None


def rendezvous_env() -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT); in a LeaderWorkerSet pod the leader's address comes from LWS."""
    addr = os.environ.get("MASTER_ADDR") or os.environ.get("LWS_LEADER_ADDRESS")
    port = os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ValueError("tensor parallelism needs MASTER_ADDR (or LWS_LEADER_ADDRESS) and MASTER_PORT")
    return addr, int(port)


def init_group(rank: int, world_size: int, device: torch.device, addr: str, port: int) -> TensorParallel:
    """Join the group at tcp://addr:port (blocks until all `world_size` ranks have joined)."""
    global _control
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    _control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return TensorParallel(rank, world_size)


def control_group() -> dist.ProcessGroup:
    if _control is None:
        raise RuntimeError("the tensor-parallel group is not initialised")
    return _control


def broadcast_command(command: object | None = None) -> object:
    """Rank 0 sends `command`; every other rank receives and returns it."""
    box = [command]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def min_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group())
    return int(t.item())


def destroy_group() -> None:
    global _control
    if dist.is_initialized():
        dist.destroy_process_group()
    _control = None
