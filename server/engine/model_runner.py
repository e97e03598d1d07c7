"""Model runner: owns the paged KV caches, turns a scheduled step into batch tensors, runs the model
and returns the logits of the rows to sample from.

Inputs are built with plain lists / numpy and become one tensor each (no per-token Python work
per layer); logits are computed only for sampled rows (the last token of a prefill that completes its
sequence, and decode tokens).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from pagoda.kernels import get_backend
from pagoda.server.engine.attention_metadata import AttentionMetadata
from pagoda.server.engine.block_manager import blocks_for_tokens
from pagoda.server.engine.cuda_graphs import DecodeGraphs
from pagoda.server.engine.layers.attention import use_backend
from pagoda.server.engine.prompt_logprobs import prompt_score_rows, score_prompt_tokens
from pagoda.server.engine.scheduler import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)

DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
CPU_DEFAULT_KV_CAP = 2 << 30  # bytes


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) × layers × kv_heads × head_dim × dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) per layer, each [num_blocks, block_size, num_kv_heads, head_dim].
    Zeroed: masked-out slots are multiplied by 0 in attention, which must not meet NaN garbage."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [
        (
            torch.zeros(shape, dtype=spec.dtype, device=device),
            torch.zeros(shape, dtype=spec.dtype, device=device),
        )
        for _ in range(spec.num_layers)
    ]


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`, with no op where it is there already (a CPU step's inputs are): docs/kernels.md
    on the small ops around a decode step."""
    return t if t.device == device else t.to(device)


def cpu_kv_budget() -> int:
    """Default KV pool on CPU: a quarter of the available RAM, at most 2 GiB."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(CPU_DEFAULT_KV_CAP, available // 4)


@dataclass
class StepInputs:
    """Everything one forward needs, independent of the scheduler's objects (so it can be sent to
    the other tensor-parallel ranks)."""

    block_copies: list[tuple[int, int]]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # rows whose logits are sampled
    prompt_rows: list[int]  # rows whose logits score prompt tokens (`prompt_logprobs`)

    def to(self, device: torch.device) -> StepInputs:
        meta = AttentionMetadata(
            **{
                f.name: v.to(device) if isinstance(v, torch.Tensor) else v
                for f in dataclasses.fields(self.meta)
                for v in [getattr(self.meta, f.name)]
            }
        )
        return dataclasses.replace(
            self, input_ids=self.input_ids.to(device), positions=self.positions.to(device), meta=meta
        )


@dataclass
class StepTimings:
    prepare_s: float = 0.0
    forward_s: float = 0.0  # model forward + logits


class ModelRunner:
    def __init__(self, model, spec: KVCacheSpec, device: torch.device, attention_backend: str = "auto") -> None:
        self.model = model
        use_backend(model, get_backend(attention_backend, device))  # chosen once, for every layer
        self.spec = spec
        self.device = device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps, once captured
        self.timings = StepTimings()

    # ---- KV pool sizing ------------------------------------------------------------------------
    def num_blocks_for_budget(
        self, kv_cache_memory: int | None, gpu_memory_utilization: float, max_num_batched_tokens: int
    ) -> int:
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget(gpu_memory_utilization, max_num_batched_tokens)
        else:
            budget = kv_cache_memory if kv_cache_memory is not None else cpu_kv_budget()
        return max(0, budget // self.spec.bytes_per_block)

    def _cuda_kv_budget(self, utilization: float, num_tokens: int) -> int:
        """utilization × total, minus weights and the peak of a profiling forward of a full step."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = blocks_for_tokens(num_tokens, self.spec.block_size)
        self.kv_caches = allocate_kv_caches(self.spec, blocks, self.device)
        temp_bytes = blocks * self.spec.bytes_per_block
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),
            num_prefill_tokens=num_tokens,
            prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            prefill_context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            prefill_block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None, :],
        )
        with torch.inference_mode():
            hidden = self.model(ids, positions, meta, self.kv_caches)
            self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        return int(utilization * total - (peak - temp_bytes) - non_torch)

    def allocate(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.graphs = None  # captured on the old pool's addresses
        self.kv_caches = allocate_kv_caches(self.spec, num_blocks, self.device)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode forward as CUDA graphs (`cuda_graphs.py`), after `allocate`."""
        max_blocks = blocks_for_tokens(max_model_len, self.spec.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs, max_blocks)

    # ---- one step --------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def _block_table_tensor(self, items: list[ScheduledSeq], device: torch.device) -> torch.Tensor:
        width = max(len(item.seq.block_table) for item in items)
        table = np.zeros((len(items), width), dtype=np.int32)
        for row, item in enumerate(items):
            table[row, : len(item.seq.block_table)] = item.seq.block_table
        return _on(torch.from_numpy(table), device)

    def prepare(self, out: SchedulerOutput, device: torch.device | None = None) -> StepInputs:
        """The step's model inputs, on `device` (default: the model's)."""
        bs = self.spec.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        sample_rows: list[int] = []
        cu_seqlens = [0]
        for item in out.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            ids.extend(seq.token_ids[start:end])
            pos = np.arange(start, end)
            positions.append(pos)
            slots.append(np.asarray(seq.block_table)[pos // bs] * bs + pos % bs)
            cu_seqlens.append(cu_seqlens[-1] + item.num_new_tokens)
            if item.completes:
                sample_rows.append(cu_seqlens[-1] - 1)
        num_prefill_tokens = cu_seqlens[-1]
        if out.decodes:
            dec_pos = np.fromiter(
                (i.seq.num_computed_tokens for i in out.decodes), dtype=np.int64, count=len(out.decodes)
            )
            ids.extend(i.seq.token_ids[i.seq.num_computed_tokens] for i in out.decodes)
            positions.append(dec_pos)
            blocks = np.fromiter(
                (i.seq.block_table[p // bs] for i, p in zip(out.decodes, dec_pos.tolist(), strict=True)),
                dtype=np.int64,
                count=len(out.decodes),
            )
            slots.append(blocks * bs + dec_pos % bs)
            for j, item in enumerate(out.decodes):
                if item.completes:
                    sample_rows.append(num_prefill_tokens + j)
        device = device or self.device
        meta = AttentionMetadata(
            slot_mapping=_on(torch.from_numpy(np.concatenate(slots).astype(np.int64)), device),
            num_prefill_tokens=num_prefill_tokens,
        )
        if out.prefills:
            meta.prefill_cu_seqlens_q = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
            meta.prefill_context_lens = torch.tensor(
                [i.seq.num_computed_tokens + i.num_new_tokens for i in out.prefills],
                dtype=torch.int32,
                device=device,
            )
            meta.prefill_block_tables = self._block_table_tensor(out.prefills, device)
        if out.decodes:
            meta.decode_context_lens = _on(torch.from_numpy((dec_pos + 1).astype(np.int32)), device)
            meta.decode_block_tables = self._block_table_tensor(out.decodes, device)
        input_ids = _on(torch.from_numpy(np.array(ids, dtype=np.int64)), device)  # torch.tensor(list): slower
        pos_tensor = _on(torch.from_numpy(np.concatenate(positions).astype(np.int64)), device)
        return StepInputs(
            list(out.block_copies), input_ids, pos_tensor, meta, sample_rows, prompt_score_rows(out)
        )

    def dispatch(self, step: StepInputs) -> StepInputs:
        """The step as this rank runs it (the tensor-parallel executor sends it to the others first)."""
        return step

    def add_failure_listener(self, listener) -> None:
        """One rank: no other process can fail under it (the tensor-parallel executor watches its ranks)."""

    def shutdown(self) -> None:
        """One rank: no other process to stop."""

    @torch.inference_mode()
    def run(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Block copies, the forward, the sampled rows' logits: (hidden states, logits)."""
        self.copy_blocks(step.block_copies)
        if self.graphs is not None and self.graphs.covers(step):
            return self.graphs.run(step)
        hidden = self.model(step.input_ids, step.positions, step.meta, self.kv_caches)
        rows = step.sample_rows  # increasing: all of them is every row (a decode step), no copy
        sampled = hidden if len(rows) == hidden.shape[0] else hidden[rows]
        logits = self.model.compute_logits(sampled) if rows else hidden.new_empty(0, 0)
        return hidden, logits

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one step; returns logits [num_sampled, vocab] and the scheduled items they belong to."""
        started = time.perf_counter()
        step = self.dispatch(self.prepare(out))
        prepared = time.perf_counter()
        hidden, logits = self.run(step)
        out.prompt_scores = score_prompt_tokens(self.model, hidden, out)  # [] unless a request asks
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so forward_s measures the forward, not its launch
        self.timings.prepare_s += prepared - started
        self.timings.forward_s += time.perf_counter() - prepared
        sampled = [item for item in out.scheduled if item.completes]
        return logits, sampled  # model dtype, on the model's device: the sampler widens and moves what it must
