"""A tensor-parallel rank other than 0: load this rank's shard, then run what rank 0 broadcasts.

Rank 0 sends one command at a time (`executor.py`): size the KV pool, allocate it, run a step, stop.
Every rank runs each step's forward and its LM-head calls, since those hold the collectives; only
rank 0 samples. A worker whose peer (rank 0 or another worker) dies gets an error from the next
collective and exits non-zero; a worker started by a local rank 0 also exits when its parent goes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import torch

logger = logging.getLogger("pagoda.tp-worker")


def rank_device(device: str, local_rank: int) -> torch.device:
    """Each rank on its own GPU (cuda:LOCAL_RANK); CPU ranks share the CPU."""
    from pagoda.server.engine.placement import resolve_device

    resolved = resolve_device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", local_rank)
    return resolved


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)  # rank 0 is gone: nothing will ever send another command

    threading.Thread(target=watch, name="pagoda-tp-parent", daemon=True).start()


def run_worker(args, rank: int, world_size: int, local_rank: int) -> None:
    from pagoda.server.engine.loader import load_model
    from pagoda.server.engine.model_runner import KVCacheSpec, ModelRunner
    from pagoda.server.engine.parallel import group
    from pagoda.server.engine.parallel.executor import rank_num_blocks
    from pagoda.server.engine.placement import set_cpu_threads
    from pagoda.server.engine.prompt_logprobs import prompt_logit_slices

    device = rank_device(args.device, local_rank)
    if device.type == "cpu":
        set_cpu_threads(args.cpu_threads)
    else:
        torch.cuda.set_device(device)
    tp = group.init_group(rank, world_size, device, *group.rendezvous_env())
    loaded = load_model(args.model, dtype=args.dtype, device=device, quantization=args.quantization, tp=tp)
    model = loaded.model
    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, loaded.dtype, args.block_size)
    runner = ModelRunner(model, spec, device, args.attention_backend)
    logger.info("rank %d/%d ready on %s", rank, world_size, device)
    with torch.inference_mode():
        while True:
            command = group.broadcast_command()
            kind = command[0]
            if kind == "budget":
                rank_num_blocks(runner, world_size, *command[1:])
            elif kind == "allocate":
                runner.allocate(command[1])
            elif kind == "step":
                step = command[1].to(device)
                hidden, _ = runner.run(step)
                for _ in prompt_logit_slices(model, hidden, step.prompt_rows):
                    pass  # rank 0 scores them; this rank's part is its share of the LM head
            elif kind == "stop":
                break
            else:
                raise RuntimeError(f"unknown command {kind!r} from rank 0")
    group.destroy_group()


def main(argv: list[str] | None = None) -> None:
    from pagoda.server.engine.config import EngineArgs

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = EngineArgs(**json.loads(argv[0]))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    _exit_with_parent()
    try:
        run_worker(args, rank, world_size, local_rank)
        status = 0
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        status = 1
    # End here rather than through interpreter finalization: Python still holds the gloo group's
    # objects after destroy_process_group, and their C++ teardown at finalization can abort the
    # process ("terminate called without an active exception", SIGABRT, seen at a clean stop).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
