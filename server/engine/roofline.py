"""Roofline of every engine step: the bytes it had to move and the FLOPs it had to do, against the
device's peaks. Formulas: docs/metrics.md ("Memory-bound or compute-bound?").

Bytes are a lower bound an ideal kernel would still move: every weight once (the input embedding only
for the step's token rows; the LM head only if a row is sampled), each sequence's attended K/V once,
the step's new K/V once, copy-on-write copies read and written. Activations are not counted.
Weight bytes come from the loaded tensors (their real dtype, quantized or not), not from a dtype guess.
FLOPs count multiply-adds as 2: the matmuls from the model config, plus attention's QKᵀ and PV.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.device_peaks import DevicePeaks
from pagoda.server.engine.layers.quantized import FEW_ROWS
from torch import nn

if TYPE_CHECKING:
    from pagoda.server.engine.scheduler import SchedulerOutput


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class ModelCosts:
    """What one step costs per token, per sampled row and per attended context position."""

    body_bytes: int  # every weight except the input embedding table and the LM head
    head_bytes: int  # the LM head (the embedding table when tied), read when any row is sampled
    # The same with each low-bit copy read instead of its dense weight: steps of few rows
    # (`layers/quantized.py`). Equal to the above for a model without low-bit copies.
    few_rows_body_bytes: int
    few_rows_head_bytes: int
    embed_row_bytes: int  # one row of the input embedding, per token
    kv_bytes_per_token: int  # K and V of one token over all layers
    body_flops_per_token: int  # 2 × the per-token matmul weights of all decoder layers
    head_flops_per_row: int  # 2 × vocab × hidden per sampled row
    attn_flops_per_context: int  # QKᵀ + PV: 4 × heads × head_dim per (query, key) pair and layer
    sliding_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_model(cls, model: nn.Module, kv_bytes_per_token: int) -> ModelCosts:
        cfg = model.cfg
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        # parameters() already lists a tied weight once; persistent buffers of the model's own
        # (not a low-bit copy's) hold weights too.
        low_bit = [m.low_bit for m in model.modules() if getattr(m, "low_bit", None) is not None]
        copies = {id(b) for copy in low_bit for b in copy.buffers()}
        persistent = model.state_dict().keys()
        buffers = [b for name, b in model.named_buffers() if name in persistent and id(b) not in copies]
        total = tensor_bytes(list(model.parameters()) + buffers)
        tied = head is embed
        embed_table = tensor_bytes([embed])
        head_bytes = tensor_bytes([head])
        body = total - embed_table - (0 if tied else head_bytes)
        few_rows_body, few_rows_head = body, head_bytes
        for module in model.modules():
            copy = getattr(module, "low_bit", None)
            if copy is None:
                continue
            saved = tensor_bytes([module.weight]) - tensor_bytes(list(copy.buffers()))
            if module is model.lm_head:
                few_rows_head -= saved
            else:
                few_rows_body -= saved
        # Under tensor parallelism: this rank's share (the roofline of one device), from its shard.
        local = model.local
        h, hd = cfg.hidden_size, cfg.head_dim
        q, kv = local.num_heads * hd, local.num_kv_heads * hd
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * local.intermediate_size  # qkv, o, gate+up+down
        return cls(
            body_bytes=body,
            head_bytes=head_bytes,
            few_rows_body_bytes=few_rows_body,
            few_rows_head_bytes=few_rows_head,
            embed_row_bytes=embed_table // embed.shape[0],
            kv_bytes_per_token=kv_bytes_per_token,
            body_flops_per_token=2 * per_layer * cfg.num_layers,
            head_flops_per_row=2 * local.vocab_per_rank * h,
            attn_flops_per_context=4 * local.num_heads * hd,
            sliding_windows=tuple(cfg.sliding_windows),
        )

    def attended(self, start: int, num_new: int) -> tuple[int, int]:
        """(K/V positions read, (query, key) pairs), both summed over the layers, for queries at
        positions start … start+num_new-1, each seeing itself and what precedes it (causal, within
        the layer's sliding window if it has one). Each sequence's K/V are read once per layer."""
        end = start + num_new
        kv_read = pairs = 0
        for window, layers in self._window_layers:
            if window is None:
                pairs += layers * ((start + 1 + end) * num_new // 2)  # Σ (p + 1) for p in [start, end)
                kv_read += layers * end
            else:
                pairs += layers * _sum_min(start + 1, end, window)
                kv_read += layers * (end - max(0, start - window + 1))
        return kv_read, pairs

    @cached_property
    def _window_layers(self) -> tuple[tuple[int | None, int], ...]:
        """(window, how many layers have it): layers of one window attend alike, so a step's sequences
        cost one sum per window, not one per layer (30 per sequence were ~40 µs of a 16-row step)."""
        return tuple(Counter(self.sliding_windows).items())


def _sum_min(a: int, b: int, w: int) -> int:
    """Σ min(x, w) for x in [a, b]."""
    if b <= w:
        return (a + b) * (b - a + 1) // 2
    if a > w:
        return w * (b - a + 1)
    return (a + w) * (w - a + 1) // 2 + w * (b - w)


@dataclass
class StepCost:
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


def step_cost(
    costs: ModelCosts,
    shape: list[tuple[int, int]],
    num_sampled: int,
    num_copied_blocks: int = 0,
    block_size: int = EngineArgs.block_size,
) -> StepCost:
    """`shape`: (tokens already in the cache, tokens run this step) per scheduled sequence."""
    tokens = sum(n for _, n in shape)
    kv_positions = pairs = 0
    for start, num_new in shape:
        read, p = costs.attended(start, num_new)
        kv_positions += read
        pairs += p
    per_layer_kv = costs.kv_bytes_per_token // max(1, len(costs.sliding_windows))
    copied = num_copied_blocks * block_size * costs.kv_bytes_per_token  # read once, written once
    body = costs.few_rows_body_bytes if tokens <= FEW_ROWS else costs.body_bytes
    head = (costs.few_rows_head_bytes if num_sampled <= FEW_ROWS else costs.head_bytes) if num_sampled else 0
    return StepCost(
        weight_bytes=body + tokens * costs.embed_row_bytes + head,
        kv_read_bytes=kv_positions * per_layer_kv + copied,
        kv_write_bytes=tokens * costs.kv_bytes_per_token + copied,
        flops=tokens * costs.body_flops_per_token
        + num_sampled * costs.head_flops_per_row
        + pairs * costs.attn_flops_per_context,
    )


def shape_of(out: SchedulerOutput) -> list[tuple[int, int]]:
    """Called before the cache counts advance: (tokens in the cache, tokens run) per sequence."""
    return [(item.seq.num_computed_tokens, item.num_new_tokens) for item in out.scheduled]


@dataclass
class StepRoofline:
    """One step's cost against the device's roofs."""

    seconds: float
    tokens: int
    cost: StepCost
    peaks: DevicePeaks

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.seconds if self.seconds > 0 else 0.0

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.cost.flops / self.cost.bytes if self.cost.bytes else 0.0

    @property
    def bound(self) -> str:
        """The roof the step sits under: memory left of the ridge point, compute right of it."""
        return "memory" if self.intensity < self.peaks.ridge_intensity else "compute"

    @property
    def bandwidth_utilization(self) -> float:
        return self.bytes_per_s / self.peaks.bytes_per_s

    @property
    def compute_utilization(self) -> float:
        return self.flops_per_s / self.peaks.flops_per_s

    def as_dict(self) -> dict:
        return {
            "seconds": self.seconds,
            "tokens": self.tokens,
            "weight_bytes": self.cost.weight_bytes,
            "kv_read_bytes": self.cost.kv_read_bytes,
            "kv_write_bytes": self.cost.kv_write_bytes,
            "bytes": self.cost.bytes,
            "flops": self.cost.flops,
            "bytes_per_s": self.bytes_per_s,
            "flops_per_s": self.flops_per_s,
            "intensity": self.intensity,
            "bandwidth_utilization": self.bandwidth_utilization,
            "compute_utilization": self.compute_utilization,
            "bound": self.bound,
        }


class RooflineMeter:
    """Running totals of the steps' rooflines and the last step. `recording`: a list to append every
    step to (benchmarks set one; the metrics read the engine's cumulative histograms instead)."""

    def __init__(self, costs: ModelCosts, peaks: DevicePeaks, block_size: int) -> None:
        self.costs = costs
        self.peaks = peaks
        self.block_size = block_size
        self.bytes_total = 0
        self.flops_total = 0
        self.seconds_total = 0.0
        self.bound_steps = {"memory": 0, "compute": 0}
        self.last: StepRoofline | None = None
        self.recording: list[StepRoofline] | None = None

    def observe(
        self, shape: list[tuple[int, int]], num_sampled: int, num_copies: int, seconds: float
    ) -> StepRoofline:
        cost = step_cost(self.costs, shape, num_sampled, num_copies, self.block_size)
        step = StepRoofline(seconds, sum(n for _, n in shape), cost, self.peaks)
        self.bytes_total += cost.bytes
        self.flops_total += cost.flops
        self.seconds_total += seconds
        self.bound_steps[step.bound] += 1
        self.last = step
        if self.recording is not None:
            self.recording.append(step)
        return step

    def stats_fields(self) -> dict:
        """The running totals, peaks and last step, as `EngineStats` fields."""
        return {
            "step_bytes_total": self.bytes_total,
            "step_flops_total": self.flops_total,
            "step_seconds_total": self.seconds_total,
            "step_bound_counts": dict(self.bound_steps),
            "peak_bytes_per_s": self.peaks.bytes_per_s,
            "peak_flops_per_s": self.peaks.flops_per_s,
            "peak_source": self.peaks.source,
            "last_step_roofline": self.last.as_dict() if self.last else None,
        }
