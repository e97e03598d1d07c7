"""KV cache capacity arithmetic for a model and a memory budget (no weights loaded).

KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × dtype bytes; the pool holds
budget // (bytes per token × block size) blocks; token capacity = blocks × block size; the maximum
concurrency at a context length L = blocks // (blocks per sequence of L tokens).
The engine logs `capacity_report` at start-up; `pagoda plan` (plan_cli.py) prints it for any budget.
"""

from __future__ import annotations

from pagoda.server.engine.block_manager import blocks_for_tokens

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def capacity_report(
    bytes_per_token: int, block_size: int, num_blocks: int, context_len: int, budget_bytes: int | None = None
) -> list[str]:
    """The capacity lines (as vLLM prints at start-up), for the plan command and the engine log."""
    capacity = num_blocks * block_size
    blocks_per_seq = blocks_for_tokens(context_len, block_size)
    concurrency = num_blocks / blocks_per_seq
    lines = [
        f"KV cache: {bytes_per_token:,} bytes per token ({bytes_per_token * block_size:,} per block of {block_size})"
    ]
    if budget_bytes is not None:
        lines.append(f"KV cache budget: {gib(budget_bytes)} ({budget_bytes:,} bytes)")
    lines += [
        f"KV cache blocks: {num_blocks:,} ({gib(num_blocks * block_size * bytes_per_token)})",
        f"KV cache capacity: {capacity:,} tokens",
        f"Maximum concurrency for {context_len:,} tokens per request: {concurrency:.2f}x",
    ]
    return lines


def kv_bytes_per_token(shape: dict, dtype: str) -> int:
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * DTYPE_BYTES[dtype]


def blocks_in_budget(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    return max(0, budget_bytes) // (bytes_per_token * block_size)


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
