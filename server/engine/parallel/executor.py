"""Rank 0's side of tensor parallelism: a ModelRunner whose every command reaches all ranks.

`start_group` starts this node's other ranks and joins the process group; `TensorParallelRunner`
broadcasts each command (size the pool, allocate it, run a step, stop) before running it itself, so
the engine and scheduler above it are the same as with one rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.model_runner import ModelRunner, StepInputs, cpu_kv_budget
from pagoda.server.engine.parallel import group
from pagoda.server.engine.parallel.launch import (
    Watchdog,
    free_port,
    ranks_per_node,
    spawn_workers,
    with_rank_threads,
)

logger = logging.getLogger(__name__)
CPU = torch.device("cpu")


def rank_num_blocks(
    runner: ModelRunner,
    world_size: int,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
) -> int:
    """Every rank sizes its own pool; the group keeps the smallest (block tables are shared). On CPU
    `kv_cache_memory` is the group's (the ranks share the RAM); on CUDA each GPU's share counts."""
    if runner.device.type == "cpu":
        kv_cache_memory = (kv_cache_memory if kv_cache_memory is not None else cpu_kv_budget()) // world_size
    blocks = ModelRunner.num_blocks_for_budget(
        runner, kv_cache_memory, gpu_memory_utilization, max_num_batched_tokens
    )
    return group.min_over_ranks(blocks)


@dataclass
class Group:
    args: EngineArgs  # with each rank's CPU threads filled in
    tp: group.TensorParallel
    watchdog: Watchdog

    def abort(self) -> None:
        self.watchdog.kill()
        group.destroy_group()


def start_group(args: EngineArgs, device: torch.device) -> Group:
    """Start ranks 1..per_node-1 on this node and join the group as rank 0."""
    args = with_rank_threads(args)
    per_node = ranks_per_node(args)
    if args.nnodes > 1:
        addr, port = group.rendezvous_env()  # the other nodes reach this pod at a known address
    else:
        addr, port = "127.0.0.1", free_port()
    procs = spawn_workers(args, range(1, per_node), addr, port)
    watchdog = Watchdog(procs, first_rank=1)
    try:
        tp = group.init_group(0, args.tensor_parallel_size, device, addr, port)
    except BaseException:
        watchdog.kill()
        raise
    logger.info("tensor parallelism: %d ranks (%d on this node)", tp.size, per_node)
    return Group(args, tp, watchdog)


class TensorParallelRunner(ModelRunner):
    def __init__(self, model, spec, device: torch.device, tp_group: Group) -> None:
        super().__init__(model, spec, device)
        self.group = tp_group
        self.closed = False

    @property
    def failure(self) -> BaseException | None:
        return self.group.watchdog.failure

    def add_failure_listener(self, listener) -> None:
        """`listener(error)` runs on the watchdog thread when a local worker dies."""
        self.group.watchdog.listeners.append(listener)

    def _send(self, *command) -> None:
        if self.failure is not None:
            raise self.failure
        group.broadcast_command(command)

    def num_blocks_for_budget(self, kv_cache_memory, gpu_memory_utilization, max_num_batched_tokens) -> int:
        args = (kv_cache_memory, gpu_memory_utilization, max_num_batched_tokens)
        self._send("budget", *args)
        return rank_num_blocks(self, self.group.tp.size, *args)

    def allocate(self, num_blocks: int) -> None:
        self._send("allocate", num_blocks)
        super().allocate(num_blocks)

    def prepare(self, out, device: torch.device | None = None) -> StepInputs:
        return super().prepare(out, CPU)  # sent as CPU tensors over the gloo control group

    def dispatch(self, step: StepInputs) -> StepInputs:
        self._send("step", step)
        return step.to(self.device)

    def shutdown(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.failure is None:
            try:
                group.broadcast_command(("stop",))
            except RuntimeError:
                logger.exception("could not tell the workers to stop")
            self.group.watchdog.stop()
            group.destroy_group()
        else:
            self.group.abort()
