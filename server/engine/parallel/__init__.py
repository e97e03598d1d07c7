"""Tensor parallelism: one scheduler (rank 0) drives N ranks that each hold a shard of the model.

- `group`: the torch.distributed process group (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE) and the
  collectives the sharded layers call;
- `sharding`: which slice of each checkpoint tensor a rank holds;
- `step_inputs`: one step's model inputs, broadcast from rank 0 to every rank;
- `executor`: rank 0's side (a ModelRunner that broadcasts each command first);
- `worker`: the other ranks' main loop;
- `launch`: starting the local worker processes and watching them.
"""
