"""Prometheus metrics of one serving pod (names and meanings: docs/metrics.md, a contract).

Engine state (queue lengths, KV blocks, cumulative counters and per-step histograms) is read from
`engine.stats()` at scrape time by a custom collector, never pushed from the step loop; the read
changes nothing, so a scrape and any other reader never take values from each other. Per-request latencies are observed
by the HTTP layer from each request's engine timestamps (`RequestOutput.metrics`), on the event loop,
which also answers the scrapes: cumulative histograms of our own, without prometheus_client's locks
(the inter-token one is observed once per streamed token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagoda.server.engine.outputs import EngineStats, RequestOutput
from pagoda.server.engine.step_histograms import Histogram
from pagoda.server.vllm_metrics import vllm_families
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# 1 ms … 10 min: a decode step on an H200 and a long CPU prefill both land in a finite bucket.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error")


class _EngineCollector(Collector):
    """Gauges and cumulative counters straight from an engine stats snapshot, read per scrape."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats | None]) -> None:
        self._model_name = model_name
        self._read_stats = read_stats

    def collect(self) -> Iterable[Metric]:
        stats = self._read_stats()
        if stats is None:  # model still loading: nothing to report yet
            return
        label = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        usage = stats.num_blocks_used / stats.num_blocks_total if stats.num_blocks_total else 0.0
        yield gauge("pagoda_num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("pagoda_num_requests_waiting", "Requests queued, not yet admitted.", stats.num_waiting)
        yield gauge("pagoda_kv_cache_usage_ratio", "KV blocks in use / total blocks (0-1).", usage)
        yield gauge("pagoda_kv_cache_blocks_total", "Physical KV blocks in the pool.", stats.num_blocks_total)
        yield gauge(
            "pagoda_kv_cache_blocks_used", "KV blocks referenced by live sequences.", stats.num_blocks_used
        )
        yield gauge("pagoda_kv_cache_capacity_tokens", "Tokens the KV pool can hold.", stats.capacity_tokens)
        yield gauge("pagoda_kv_cache_bytes", "Bytes of the KV pool, over every rank.", stats.kv_cache_bytes)
        yield gauge(
            "pagoda_tensor_parallel_size", "Ranks the model is split over (one replica).",
            stats.tensor_parallel_size,
        )  # fmt: skip
        yield gauge(
            "pagoda_kv_cache_shared_blocks", "KV blocks referenced by more than one sequence.",
            stats.num_shared_blocks,
        )  # fmt: skip
        yield counter("pagoda_prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens)
        yield counter("pagoda_generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("pagoda_preemptions", "Sequences preempted for lack of KV blocks.", stats.preemptions)
        yield counter(
            "pagoda_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )  # fmt: skip
        yield counter(
            "pagoda_prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        steps = stats.step_histograms
        yield _histogram("pagoda_iteration_tokens", "Tokens (prefill + decode) run in one engine step.",
                         steps.tokens, label)  # fmt: skip
        yield from _roofline_families(stats, label)
        yield counter(
            "pagoda_engine_busy_seconds",
            "Wall time the engine loop spent on steps: scheduling, forwards, sampling and handing the outputs "
            "to the server.",
            stats.loop_busy_seconds_total,
        )
        yield counter(
            "pagoda_engine_handoff_seconds",
            "Wall time the engine loop spent handing steps' outputs to the server's event loop.",
            stats.handoff_seconds_total,
        )
        info = GaugeMetricFamily(
            "pagoda_engine_info",
            "Engine configuration (value is always 1).",
            labels=["model_name", "block_size", "num_blocks", "max_model_len", "dtype", "quantization"],
        )
        info.add_metric(
            [self._model_name, str(stats.block_size), str(stats.num_blocks_total), str(stats.max_model_len),
             stats.dtype, stats.quantization],
            1,
        )  # fmt: skip
        yield info


def _roofline_families(stats: EngineStats, label: list[str]) -> Iterable[Metric]:
    """The steps' roofline (server/engine/roofline.py; formulas in docs/metrics.md)."""
    for name, doc, value in (
        ("pagoda_step_bytes", "Bytes the steps had to move: weights + KV read + KV written.",
         stats.step_bytes_total),
        ("pagoda_step_flops", "Floating-point operations the steps did.", stats.step_flops_total),
        ("pagoda_step_forward_seconds", "Time in the steps' model forwards.", stats.step_seconds_total),
    ):  # fmt: skip
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(label, value)
        yield family
    bound = CounterMetricFamily(
        "pagoda_step_bound",
        "Steps by the roof they sit under (memory or compute).",
        labels=["model_name", "bound"],
    )
    for side in ("memory", "compute"):
        bound.add_metric([*label, side], stats.step_bound_counts.get(side, 0))
    yield bound
    for name, doc, value in (
        ("pagoda_step_peak_bytes_per_second", "The device's peak memory bandwidth.", stats.peak_bytes_per_s),
        ("pagoda_step_peak_flops_per_second", "The device's peak FLOP/s in the model's dtype.",
         stats.peak_flops_per_s),
    ):  # fmt: skip
        family = GaugeMetricFamily(name, doc + " Label source: a datasheet URL or probe.",
                                   labels=["model_name", "source"])  # fmt: skip
        family.add_metric([*label, stats.peak_source], value)
        yield family
    steps = stats.step_histograms
    for name, doc, histogram in (
        ("pagoda_step_bandwidth_utilization", "Per step: bytes moved / step time / the device's peak bandwidth.",
         steps.bandwidth_utilization),
        ("pagoda_step_compute_utilization", "Per step: FLOPs / step time / the device's peak FLOP/s.",
         steps.compute_utilization),
        ("pagoda_step_arithmetic_intensity", "Per step: FLOPs per byte moved.", steps.intensity),
    ):  # fmt: skip
        yield _histogram(name, doc, histogram, label)


def _histogram(name: str, doc: str, histogram: Histogram, label: list[str]) -> HistogramMetricFamily:
    """A cumulative histogram of our own, exported as prometheus_client's own histograms are."""
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    buckets = [(floatToGoString(bound), count) for bound, count in histogram.cumulative()]
    family.add_metric(label, buckets, histogram.sum)
    return family


class _LatencyCollector(Collector):
    """The per-request latency histograms the HTTP layer observes."""

    def __init__(self, model_name: str, histograms: list[tuple[str, str, Histogram]]) -> None:
        self._label = [model_name]
        self._histograms = histograms

    def collect(self) -> Iterable[Metric]:
        for name, doc, histogram in self._histograms:
            yield _histogram(name, doc, histogram, self._label)


class ServerMetrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self, model_name: str, vllm_compatible: bool = False) -> None:
        self.model_name = model_name
        self.vllm_compatible = vllm_compatible  # also export the values under vLLM's names
        self.registry = CollectorRegistry()
        self._read_stats: Callable[[], EngineStats] | None = None
        self.registry.register(_EngineCollector(model_name, self.read_stats))

        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)
        self.registry.register(_LatencyCollector(model_name, [
            ("pagoda_time_to_first_token_seconds", "Arrival to first generated token.", self.ttft),
            ("pagoda_inter_token_latency_seconds", "Gap between consecutive output tokens.", self.itl),
            ("pagoda_e2e_request_latency_seconds", "Arrival to finish.", self.e2e),
            ("pagoda_request_queue_time_seconds", "Arrival to first scheduled.", self.queue_time),
        ]))  # fmt: skip
        finished = Counter(
            "pagoda_requests_finished",
            "Finished requests by reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.finished = {reason: finished.labels(model_name, reason) for reason in FINISHED_REASONS}

    def attach(self, stats: Callable[[], EngineStats]) -> None:
        """Start reading engine stats (called once the model is loaded)."""
        self._read_stats = stats

    def read_stats(self) -> EngineStats | None:
        return self._read_stats() if self._read_stats else None

    def families(self) -> list[Metric]:
        """Everything one scrape exports: pagoda's families (read once), then their vLLM copies."""
        families = list(self.registry.collect())
        if self.vllm_compatible:
            families += vllm_families(families)
        return families

    def exposition(self) -> bytes:
        return generate_latest(_Collected(self.families()))

    def request_tracker(self) -> RequestTracker:
        return RequestTracker(self)


class _Collected:
    """Already collected families, in the shape `generate_latest` reads."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class RequestTracker:
    """Turns one engine request's outputs (deltas) into latency observations; finish exactly once.
    Inter-token latency follows the first sequence (index 0), as vLLM's does."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last_token_time: float | None = None
        self._done = False

    def update(self, output: RequestOutput) -> None:
        first = next((c for c in output.outputs if c.index == 0), None)
        new = len(first.token_ids) if first is not None else 0
        last_token_time = output.metrics.last_token_time
        if new and last_token_time is not None:
            if self._last_token_time is not None:
                # An output may hold several steps' tokens; spread the gap evenly over them.
                self._metrics.itl.observe(max(last_token_time - self._last_token_time, 0.0) / new, new)
            elif new > 1:  # the first output already holds several tokens: gaps after the first one
                first_token_time = output.metrics.first_token_time or last_token_time
                self._metrics.itl.observe(max(last_token_time - first_token_time, 0.0) / (new - 1), new - 1)
            self._last_token_time = last_token_time
        if output.finished:
            self.finish((first.finish_reason if first is not None else None) or "stop", output)

    def finish(self, reason: str, output: RequestOutput | None = None) -> None:
        if self._done:
            return
        self._done = True
        self._metrics.finished[reason if reason in FINISHED_REASONS else "stop"].inc()
        if output is None:
            return
        times = output.metrics
        if times.first_scheduled_time is not None:
            self._metrics.queue_time.observe(max(times.first_scheduled_time - times.arrival_time, 0.0))
        if times.first_token_time is not None:
            self._metrics.ttft.observe(max(times.first_token_time - times.arrival_time, 0.0))
        end = times.finished_time or times.last_token_time
        if end is not None:
            self._metrics.e2e.observe(max(end - times.arrival_time, 0.0))
