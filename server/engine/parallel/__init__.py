"""Tensor parallelism: one scheduler (rank 0) drives N ranks that each hold a shard of the model.

- `group`: the torch.distributed process group (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE) and the
  collectives the sharded layers call;
- `sharding`: which slice of each checkpoint tensor a rank holds;
- `executor`: rank 0's side (a ModelRunner that broadcasts each command first; a step travels as
  `model_runner.StepInputs`, plain tensors and lists, never the scheduler's objects);
- `worker`: the other ranks' main loop;
- `launch`: starting a node's worker processes and watching them (`pagoda serve` on node 0,
  `pagoda worker` on the other nodes of a multi-node group).
"""
