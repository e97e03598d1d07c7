"""What the engine hands back: per-request deltas, their accumulation, and engine-wide stats.

Each step the engine hands out, per request that moved, what is new since its previous output: the
new token ids, text and logprobs of each sequence (`CompletionOutput`), so a step costs the same
however long the outputs grow. The server streams deltas as they are; `OutputAccumulator` joins
them into whole outputs (the offline API, non-streamed responses).
"""

from __future__ import annotations

from collections.abc import Iterable
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

    def snapshot(self) -> RequestMetrics:
        """The times as of now (the engine goes on): a fifth of `copy.copy`'s cost, once per output."""
        return RequestMetrics(
            self.arrival_time, self.first_scheduled_time, self.first_token_time, self.last_token_time,
            self.finished_time,
        )  # fmt: skip


@dataclass
class CompletionOutput:
    """One sequence: from the engine, what is new since its previous output; accumulated, all of it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sequence's so far
    logprobs: list[dict[int, float]] | None  # one dict per token in `token_ids`: chosen + top-k
    finish_reason: str | None = None  # None, "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """From the engine: the sequences with news this step (the last output, finished=True, lists every
    sequence with its finish reason); beam search hands out one output, at the end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs: per prompt token {token: logprob, + top-k}, None for the first;
    # on the request's first output only
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None  # rank of each prompt token (1 = likeliest)


class OutputAccumulator:
    """Joins one request's deltas into its whole output (each delta costs what it holds)."""

    def __init__(self) -> None:
        self._last: RequestOutput | None = None
        self._prompt: tuple[list | None, list | None] = (None, None)
        self._choices: dict[int, tuple[list[str], CompletionOutput]] = {}  # index -> (text parts, whole)

    def add(self, delta: RequestOutput) -> None:
        if self._last is None:
            self._prompt = (delta.prompt_logprobs, delta.prompt_token_ranks)
        self._last = delta
        for choice in delta.outputs:
            entry = self._choices.get(choice.index)
            if entry is None:
                logprobs = [] if choice.logprobs is not None else None
                entry = self._choices[choice.index] = ([], CompletionOutput(choice.index, "", [], None, logprobs))
            parts, whole = entry
            parts.append(choice.text)
            whole.token_ids.extend(choice.token_ids)
            if whole.logprobs is not None and choice.logprobs is not None:
                whole.logprobs.extend(choice.logprobs)
            whole.cumulative_logprob = choice.cumulative_logprob
            whole.finish_reason, whole.stop_reason = choice.finish_reason, choice.stop_reason

    def result(self) -> RequestOutput:
        last = self._last
        assert last is not None, "no output yet"
        outputs = []
        for index in sorted(self._choices):
            parts, whole = self._choices[index]
            whole.text = "".join(parts)
            parts[:] = [whole.text]
            outputs.append(whole)
        prompt_logprobs, prompt_token_ranks = self._prompt
        return RequestOutput(
            last.request_id, last.prompt, last.prompt_token_ids, outputs, last.finished,
            last.num_cached_tokens, last.metrics, prompt_logprobs, prompt_token_ranks,
        )  # fmt: skip


class OutputCollector:
    """The deltas of many requests joined per request: `collector[request_id]` is its whole output
    so far (the offline API's loop, and anything else that drives `LLMEngine.step` itself)."""

    def __init__(self) -> None:
        self._requests: dict[str, OutputAccumulator] = {}

    def add(self, deltas: Iterable[RequestOutput]) -> list[str]:
        """Join the deltas; returns the ids of the requests they finished."""
        finished = []
        for delta in deltas:
            self._requests.setdefault(delta.request_id, OutputAccumulator()).add(delta)
            if delta.finished:
                finished.append(delta.request_id)
        return finished

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __getitem__(self, request_id: str) -> RequestOutput:
        return self._requests[request_id].result()


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
    capacity_tokens: int = 0  # of the whole tensor-parallel group: every rank holds each token's share
    tensor_parallel_size: int = 1
    kv_cache_bytes: int = 0  # the pool's bytes over every rank of the group
    max_model_len: int = 0
    dtype: str = ""
    quantization: str = ""  # of the weights: "none", "gguf" or "int4" (loader.resolve_quantization)
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
    # The serving front's step loop (`async_engine.py`): wall time with work (every step's scheduling,
    # forward, sampling and bookkeeping, and the hand-off), and the hand-off of outputs to the server
    loop_busy_seconds_total: float = 0.0
    handoff_seconds_total: float = 0.0
