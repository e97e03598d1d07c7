"""What the engine hands back: per-request snapshots and an engine-wide stats snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.step_histograms import StepHistograms


@dataclass
class RequestMetrics:
    """time.monotonic() seconds; None until known."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # one dict per output token: chosen + top-k
    finish_reason: str | None = None  # None, "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs: per prompt token {token: logprob, + top-k}, None for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None  # rank of each prompt token (1 = likeliest)


@dataclass
class EngineStats:
    """A plain read of the engine for /metrics and the views: gauges and cumulative counters only, so
    readers take differences and no read changes what the next one sees."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_shared_blocks: int = 0  # ref_count > 1
    block_size: int = EngineArgs.block_size
    capacity_tokens: int = 0
    max_model_len: int = 0
    dtype: str = ""
    # Cumulative counters
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    num_steps: int = 0
    # Per step, cumulative: tokens run and the roofline's utilisations and intensity
    step_histograms: StepHistograms = field(default_factory=StepHistograms)
    # Roofline (server/engine/roofline.py): running totals
    step_bytes_total: int = 0
    step_flops_total: int = 0
    step_seconds_total: float = 0.0
    step_bound_counts: dict[str, int] = field(default_factory=dict)
    peak_bytes_per_s: float = 0.0
    peak_flops_per_s: float = 0.0
    peak_source: str = ""
    last_step_roofline: dict | None = None
