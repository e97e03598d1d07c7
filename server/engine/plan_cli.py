"""`pagoda plan`: print the KV cache capacity (capacity.py's arithmetic) for a model and a memory budget."""

from __future__ import annotations

import argparse

from pagoda.server.engine.capacity import (
    DTYPE_BYTES,
    blocks_in_budget,
    capacity_report,
    gib,
    kv_bytes_per_token,
    model_shape,
)

HELP = "print KV cache capacity (bytes/token, blocks, tokens, max concurrency) for a model and memory budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagoda.server.engine.config import DEFAULTS, parse_bytes

    parser.add_argument(
        "--model", help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_BYTES],
        help="KV dtype (auto = bfloat16 on GPU, float32 on CPU)",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        help="GPU memory, e.g. 80GiB (uses --gpu-memory-utilization, minus weights)",
    )
    budget.add_argument("--kv-cache-memory", type=parse_bytes, help="KV pool size, e.g. 2GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULTS["gpu_memory_utilization"])
    parser.add_argument("--block-size", type=int, default=DEFAULTS["block_size"])
    parser.add_argument(
        "--context-len", type=int, help="tokens per request for the concurrency line (default: max_model_len)"
    )


def main(args: argparse.Namespace) -> int:
    shape, max_model_len, num_params = model_shape(args.model)
    on_gpu = args.gpu_memory is not None
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    bytes_per_token = kv_bytes_per_token(shape, dtype)
    if on_gpu:
        weights = num_params * DTYPE_BYTES[dtype]
        budget = int(args.gpu_memory * args.gpu_memory_utilization) - weights
        print(
            f"weights: ~{num_params / 1e6:.0f}M parameters, {gib(weights)} at {dtype} (activations not included)"
        )
    elif args.kv_cache_memory is not None:
        budget = args.kv_cache_memory
    else:
        from pagoda.server.engine.model_runner import cpu_kv_budget

        budget = cpu_kv_budget()
    print(
        f"model: {shape['num_layers']} layers × {shape['num_kv_heads']} kv heads × head_dim {shape['head_dim']}, "
        f"{dtype}, max_model_len {max_model_len:,}"
    )
    num_blocks = blocks_in_budget(budget, bytes_per_token, args.block_size)
    for line in capacity_report(
        bytes_per_token, args.block_size, num_blocks, args.context_len or max_model_len, budget
    ):
        print(line)
    return 0
