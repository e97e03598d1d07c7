"""Drives a model through paged steps the way the engine does, with a tiny block allocator of its own.

Blocks are handed out from a shuffled free list, so each sequence's blocks are scattered in the
cache and attention must follow the block tables.
"""

from __future__ import annotations

import random

import torch
from pagoda.kernels import get_backend
from pagoda.server.engine.attention_metadata import AttentionMetadata
from pagoda.server.engine.layers.attention import use_backend


class PagedHarness:
    def __init__(self, model, *, block_size: int, num_blocks: int, seed: int = 0, attention_backend: str = "auto") -> None:
        self.model, self.block_size = model, block_size
        use_backend(model, get_backend(attention_backend, "cpu"))
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
            for _ in range(model.num_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def _slots(self, seq: str, count: int) -> list[int]:
        """Cache slots for the next `count` tokens of `seq`, allocating blocks as they fill."""
        table = self.block_tables.setdefault(seq, [])
        start = self.lengths.get(seq, 0)
        slots = []
        for pos in range(start, start + count):
            if pos % self.block_size == 0:
                table.append(self.free_blocks.pop())
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.lengths[seq] = start + count
        return slots

    def _tables(self, seqs: list[str]) -> torch.Tensor:
        width = max(len(self.block_tables[s]) for s in seqs)
        return torch.tensor(
            [self.block_tables[s] + [0] * (width - len(self.block_tables[s])) for s in seqs],
            dtype=torch.int32,
        )

    @torch.no_grad()
    def step(self, prefills: dict[str, list[int]], decodes: dict[str, int]) -> dict[str, torch.Tensor]:
        """One packed step: prefill chunks first, then one decode token per sequence.

        Returns each sequence's logits (the model dtype) for the tokens it fed this step ([n, vocab]).
        """
        ids, positions, slots, q_lens = [], [], [], []
        for seq, tokens in prefills.items():
            start = self.lengths.get(seq, 0)
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += self._slots(seq, len(tokens))
            q_lens.append(len(tokens))
        for seq, token in decodes.items():
            positions.append(self.lengths[seq])
            ids.append(token)
            slots += self._slots(seq, 1)
        num_prefill = sum(q_lens)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), num_prefill_tokens=num_prefill
        )
        if prefills:
            cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            meta.prefill_cu_seqlens_q = cu
            meta.prefill_context_lens = torch.tensor([self.lengths[s] for s in prefills], dtype=torch.int32)
            meta.prefill_block_tables = self._tables(list(prefills))
        if decodes:
            meta.decode_context_lens = torch.tensor([self.lengths[s] for s in decodes], dtype=torch.int32)
            meta.decode_block_tables = self._tables(list(decodes))
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches)
        logits = self.model.compute_logits(hidden)
        out, offset = {}, 0
        for seq, n in [*zip(prefills, q_lens, strict=True), *((s, 1) for s in decodes)]:
            out[seq] = logits[offset : offset + n]
            offset += n
        return out


# A schedule of engine-like steps over four sequences "a".."d": prefill together, decode, a mixed step
# (a chunk of c prefilling while a and b decode), c's second chunk after cached context, a 1-token
# prompt, then decodes of everything. Each entry: ({seq: prompt slice}, [decoding seqs]).
PROMPT_LENGTHS = {"a": 17, "b": 5, "c": 40, "d": 1}
SCHEDULE: list[tuple[dict[str, slice], list[str]]] = [
    ({"a": slice(0, 17), "b": slice(0, 5)}, []),
    ({}, ["a", "b"]),
    ({"c": slice(0, 24)}, ["a", "b"]),
    ({"c": slice(24, 40), "d": slice(0, 1)}, ["a", "b"]),
    ({}, ["a", "b", "c", "d"]),
    ({}, ["a", "b", "c", "d"]),
    ({}, ["c", "d"]),
]


def run_schedule(
    harness: PagedHarness, sequences: dict[str, list[int]]
) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Feed `sequences` (prompt + continuation tokens, teacher-forced) through SCHEDULE.

    Returns, per sequence, (first position, logits rows) for every step it took part in.
    """
    fed = dict.fromkeys(sequences, 0)
    results: dict[str, list[tuple[int, torch.Tensor]]] = {seq: [] for seq in sequences}
    for prefill_slices, decoding in SCHEDULE:
        prefills = {seq: sequences[seq][part] for seq, part in prefill_slices.items()}
        decodes = {seq: sequences[seq][fed[seq]] for seq in decoding}
        for seq, logits in harness.step(prefills, decodes).items():
            results[seq].append((fed[seq], logits))
            fed[seq] += logits.shape[0]
    return results


def schedule_token_counts() -> dict[str, int]:
    """How many tokens of each sequence SCHEDULE feeds."""
    counts = dict.fromkeys(PROMPT_LENGTHS, 0)
    for prefill_slices, decoding in SCHEDULE:
        for seq, part in prefill_slices.items():
            counts[seq] += part.stop - part.start
        for seq in decoding:
            counts[seq] += 1
    return counts


def max_logits_diff(
    results: dict[str, list[tuple[int, torch.Tensor]]], reference: dict[str, torch.Tensor]
) -> float:
    """Largest |ours - reference| over every position fed, reference[seq] being [seq_len, vocab]."""
    worst = 0.0
    for seq, chunks in results.items():
        for start, logits in chunks:
            expected = reference[seq][start : start + logits.shape[0]]
            worst = max(worst, (logits - expected).abs().max().item())
    return worst
