"""`pagoda plan`: KV cache capacity arithmetic for a model and a memory budget (no weights loaded).

KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × dtype bytes; the pool holds
budget // (bytes per token × block size) blocks; token capacity = blocks × block size; the maximum
concurrency at a context length L = capacity // (blocks per sequence of L tokens × block size).
The engine logs the same lines at start-up.

With `--tensor-parallel-size N` each rank holds kv_heads / N heads (one, replicated, when there are
fewer KV heads than ranks) and weights / N; `--gpu-memory` is one GPU's, `--kv-cache-memory` the
group's. The lines are per rank; the token capacity and concurrency are the whole group's.
"""

from __future__ import annotations

import argparse

HELP = "print KV cache capacity (bytes/token, blocks, tokens, max concurrency) for a model and memory budget"

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def capacity_report(
    bytes_per_token: int, block_size: int, num_blocks: int, context_len: int, budget_bytes: int | None = None
) -> list[str]:
    """The capacity lines (as vLLM prints at start-up), for the plan command and the engine log."""
    capacity = num_blocks * block_size
    blocks_per_seq = -(-context_len // block_size)
    concurrency = num_blocks / blocks_per_seq
    lines = [
        f"KV cache: {bytes_per_token:,} bytes per token ({bytes_per_token * block_size:,} per block of {block_size})"
    ]
    if budget_bytes is not None:
        lines.append(f"KV cache budget: {_gib(budget_bytes)} ({budget_bytes:,} bytes)")
    lines += [
        f"KV cache blocks: {num_blocks:,} ({_gib(num_blocks * block_size * bytes_per_token)})",
        f"KV cache capacity: {capacity:,} tokens",
        f"Maximum concurrency for {context_len:,} tokens per request: {concurrency:.2f}x",
    ]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagoda.server.engine.config import parse_bytes

    parser.add_argument(
        "--model", help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *_DTYPE_BYTES],
        help="KV dtype (auto = bfloat16 on GPU, float32 on CPU)",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        help="GPU memory, e.g. 80GiB (uses --gpu-memory-utilization, minus weights)",
    )
    budget.add_argument("--kv-cache-memory", type=parse_bytes, help="KV pool size, e.g. 2GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model is split over")
    parser.add_argument(
        "--context-len", type=int, help="tokens per request for the concurrency line (default: max_model_len)"
    )


def model_shape(model: str | None) -> tuple[dict, int, int]:
    """(kv shape numbers, max_model_len, weight bytes at the config's dtype) from the model's config only."""
    from pagoda.server.engine.loader import resolve_model_source

    source = resolve_model_source(model)
    if source.kind == "gguf":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source.path)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shape = {
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
    }
    hidden, layers, inter, vocab = (
        config.hidden_size,
        config.num_hidden_layers,
        config.intermediate_size,
        config.vocab_size,
    )
    kv_dim = shape["num_kv_heads"] * head_dim
    params = (
        layers * (hidden * (heads * head_dim) * 2 + hidden * kv_dim * 2 + 3 * hidden * inter) + vocab * hidden
    )
    if not getattr(config, "tie_word_embeddings", False):
        params += vocab * hidden
    return shape, int(config.max_position_embeddings), params


def rank_kv_heads(kv_heads: int, ranks: int) -> int:
    """KV heads one rank holds (parallel/sharding.py's rule, without the model)."""
    if ranks < 1 or (kv_heads >= ranks and kv_heads % ranks) or (kv_heads < ranks and ranks % kv_heads):
        raise SystemExit(f"--tensor-parallel-size {ranks} does not split {kv_heads} KV heads")
    return max(1, kv_heads // ranks)


def main(args: argparse.Namespace) -> int:
    shape, max_model_len, num_params = model_shape(args.model)
    on_gpu = args.gpu_memory is not None
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    dtype_bytes = _DTYPE_BYTES[dtype]
    ranks = args.tensor_parallel_size
    kv_heads = rank_kv_heads(shape["num_kv_heads"], ranks)
    bytes_per_token = 2 * shape["num_layers"] * kv_heads * shape["head_dim"] * dtype_bytes
    if ranks > 1:
        print(f"tensor parallelism: {ranks} ranks, {kv_heads} KV heads each; bytes are per rank, tokens the group's")
    if on_gpu:
        weights = num_params * dtype_bytes // ranks
        budget = int(args.gpu_memory * args.gpu_memory_utilization) - weights
        print(
            f"weights: ~{num_params / 1e6:.0f}M parameters, {_gib(weights)}{' per rank' if ranks > 1 else ''} "
            f"at {dtype} (activations not included)"
        )
    elif args.kv_cache_memory is not None:
        budget = args.kv_cache_memory // ranks
    else:
        from pagoda.server.engine.model_runner import cpu_kv_budget

        budget = cpu_kv_budget() // ranks
    print(
        f"model: {shape['num_layers']} layers × {shape['num_kv_heads']} kv heads × head_dim {shape['head_dim']}, "
        f"{dtype}, max_model_len {max_model_len:,}"
    )
    num_blocks = max(0, budget) // (bytes_per_token * args.block_size)
    for line in capacity_report(
        bytes_per_token, args.block_size, num_blocks, args.context_len or max_model_len, budget
    ):
        print(line)
    return 0
