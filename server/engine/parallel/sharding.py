"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style).

Column-parallel (split along the output rows): q/k/v and gate/up; their outputs stay split per rank.
Row-parallel (split along the input columns): o and down, summed by one all-reduce each.
Vocab-parallel: the embedding and the LM head, ceil(vocab / N) rows per rank (the last rank's tail
rows are zero padding). Attention heads split across ranks; KV heads split too, or — when there are
fewer KV heads than ranks — each rank holds the one KV head its query heads read (replicated).
Norms, q/k norms and the biases added after a reduce are whole on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagoda.server.engine.parallel.group import TensorParallel


@dataclass(frozen=True)
class Slice:
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class LocalShape:
    """The per-rank sizes of one model under one tensor-parallel rank."""

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int
    intermediate_size: int
    vocab_per_rank: int
    tp: TensorParallel

    @property
    def first_vocab_row(self) -> int:
        return self.tp.rank * self.vocab_per_rank


def check_shardable(cfg, size: int) -> None:
    """Raise ValueError when `cfg` cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be at least 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (need a multiple of {size}, or a divisor of it)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's " + ", ".join(problems))


def local_shape(cfg, tp: TensorParallel) -> LocalShape:
    check_shardable(cfg, tp.size)
    heads = cfg.num_heads // tp.size
    kv = cfg.num_kv_heads
    if kv >= tp.size:
        kv_local, first_kv = kv // tp.size, tp.rank * (kv // tp.size)
    else:  # replicated: size / kv ranks share each KV head
        kv_local, first_kv = 1, tp.rank // (tp.size // kv)
    return LocalShape(
        num_heads=heads,
        num_kv_heads=kv_local,
        first_head=tp.rank * heads,
        first_kv_head=first_kv,
        intermediate_size=cfg.intermediate_size // tp.size,
        vocab_per_rank=-(-cfg.vocab_size // tp.size),
        tp=tp,
    )


_PROJ = re.compile(r"\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.(weight|bias)$")


def slice_of(name: str, cfg, local: LocalShape) -> Slice | None:
    """The slice of HF tensor `name` this rank loads; None = the whole tensor."""
    if local.tp.size == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start = local.first_vocab_row
        return Slice(0, start, max(0, min(local.vocab_per_rank, cfg.vocab_size - start)))
    match = _PROJ.search(name)
    if match is None:
        return None  # norms
    proj, kind = match.groups()
    hd = cfg.head_dim
    if proj == "q":
        return Slice(0, local.first_head * hd, local.num_heads * hd)
    if proj in ("k", "v"):
        return Slice(0, local.first_kv_head * hd, local.num_kv_heads * hd)
    if proj in ("gate", "up"):
        return Slice(0, local.tp.rank * local.intermediate_size, local.intermediate_size)
    if kind == "bias":  # o/down bias: added once, after the all-reduce
        return None
    if proj == "o":
        return Slice(1, local.first_head * hd, local.num_heads * hd)
    return Slice(1, local.tp.rank * local.intermediate_size, local.intermediate_size)  # down
