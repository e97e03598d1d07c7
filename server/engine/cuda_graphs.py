"""CUDA graphs of the decode forward: a decode step replays one graph instead of launching ~500 kernels.

On a GPU a small model's decode step is bound by the host, not the device: each torch op and Triton
launch costs 10-30 µs of Python and driver time, and a Llama layer is ~30 of them (a 1B Llama's decode
step at one sequence on an H200: 10.7 ms eager, 2.6 ms replaying the graph). So the
runner captures the forward and the LM head once per batch size bucket, after the KV pool exists, and
replays them for decode-only steps; every other step (prefill chunks, prompt scoring, more sequences
than the largest bucket) runs eagerly, unchanged.

A graph reads its inputs from static buffers and writes its outputs to static tensors, so a step is:
copy the step's inputs into the buffers, pad the rows up to the bucket, replay, slice. A padding row
stores its K/V nowhere (slot -1) and attends to one token of block 0 (read, never written): its output
is discarded. The decode kernel sizes its split from the block table's width, so the graphs use the
widest table a sequence can have (`max_model_len` tokens) and a shorter sequence leaves the extra
partitions empty. The graphs share one memory pool, sized by the largest bucket (its activations and
fp32 logits, rows x vocab), allocated after the KV pool: it comes out of the share of the GPU that
`--gpu-memory-utilization` leaves free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from pagoda.server.engine.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURED_SEQS = 512  # bounds the capture time and the pool; larger decode batches run eagerly

Outputs = tuple[torch.Tensor, torch.Tensor]  # (hidden states, logits), one row per sequence
# Captures `forward` and returns a function that replays it into the tensors of its first call; the
# memory pool is shared by every bucket's graph (only one replays at a time).
Capture = Callable[[Callable[[], Outputs], object], tuple[Callable[[], None], Outputs, object]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to the batch limit
    (a step pads its rows up to the next one: at most 15 wasted rows, next to nothing when bound by
    the weights' read)."""
    limit = min(max_num_seqs, MAX_CAPTURED_SEQS)
    sizes = [size for size in (1, 2, 4, 8) if size <= limit]
    sizes += list(range(16, limit + 1, 16))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def cuda_capture(forward: Callable[[], Outputs], pool) -> tuple[Callable[[], None], Outputs, object]:
    forward()  # warm-up outside the capture: Triton compiles, cuBLAS picks its kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = forward()
    return graph.replay, outputs, graph.pool()


class DecodeGraphs:
    """The captured decode forwards of one model on one KV pool (recapture if the pool changes)."""

    def __init__(
        self,
        model,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        capture: Capture = cuda_capture,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        device = kv_caches[0][0].device
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.replays: dict[int, tuple[Callable[[], None], Outputs]] = {}
        started, pool = time.perf_counter(), None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the smaller ones fit in its pool
                replay, outputs, pool = capture(lambda size=size: self._forward(size), pool)
                self.replays[size] = (replay, outputs)
        self.capture_seconds = time.perf_counter() - started
        logger.info(
            "captured %d decode graphs (1-%d sequences) in %.1f s",
            len(self.sizes),
            rows,
            self.capture_seconds,
        )

    def _forward(self, rows: int) -> Outputs:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            num_prefill_tokens=0,
            decode_context_lens=self.context_lens[:rows],
            decode_block_tables=self.block_tables[:rows],
        )
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], meta, self.kv_caches)
        return hidden, self.model.compute_logits(hidden).float()  # the sampler's widening, inside the graph

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch that holds `num_seqs` rows (None: more than the largest)."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def covers(self, step) -> bool:
        """A decode-only step whose every row samples and whose block tables fit the buffers."""
        meta = step.meta
        return (
            meta.num_prefill_tokens == 0
            and meta.decode_block_tables is not None
            and not step.prompt_rows
            and len(step.sample_rows) == meta.num_tokens
            and self.bucket(meta.num_tokens) is not None
            and meta.decode_block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(self, step) -> Outputs:
        """The step's (hidden states, logits): views of the graph's outputs, valid until the next run."""
        meta, rows = step.meta, step.meta.num_tokens
        size = self.bucket(rows)
        self.input_ids[:rows].copy_(step.input_ids)
        self.positions[:rows].copy_(step.positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.context_lens[:rows].copy_(meta.decode_context_lens)
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:rows, :width].copy_(meta.decode_block_tables)
        if size > rows:  # padding rows (a larger batch's leftovers): nothing stored, block 0 read
            self.slot_mapping[rows:size].fill_(-1)
            self.context_lens[rows:size].fill_(1)
            self.block_tables[rows:size, 0].fill_(0)
        replay, (hidden, logits) = self.replays[size]
        replay()
        return hidden[:rows], logits[:rows]
