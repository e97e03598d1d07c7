"""docs/metrics.md is a contract: the names it lists and the names a server exports must agree."""

from __future__ import annotations

import re
from pathlib import Path

from pagoda.server.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from pagoda.server.engine.step_histograms import StepHistograms
from pagoda.server.pod_metrics import ServerMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented_names() -> set[str]:
    return set(re.findall(r"^\| `(pagoda_[a-z0-9_]+)` \|", DOC.read_text(), flags=re.MULTILINE))


def exported_families(metrics: ServerMetrics) -> dict[str, object]:
    """Exposition names: counters as `<name>_total`, everything else by its family name."""
    return {m.name + ("_total" if m.type == "counter" else ""): m for m in metrics.registry.collect()}


def steps_of(*token_counts: int) -> StepHistograms:
    steps = StepHistograms()
    for count in token_counts:
        steps.tokens.observe(count)
    return steps


def test_documented_and_exported_names_agree():
    metrics = ServerMetrics("m")
    stats = EngineStats(num_blocks_total=10, num_blocks_used=4, step_histograms=steps_of(3, 70))
    metrics.attach(lambda: stats)
    families = exported_families(metrics)
    assert documented_names() == set(families)
    assert len(families) == 32
    for family in families.values():
        assert all(sample.labels.get("model_name") == "m" for sample in family.samples), family.name


def test_scrape_reads_engine_state_and_cumulative_step_histograms():
    metrics = ServerMetrics("m")
    first = EngineStats(num_blocks_total=8, num_blocks_used=2, step_histograms=steps_of(5, 300))
    snapshots = iter([first, first])
    metrics.attach(lambda: next(snapshots, EngineStats(num_blocks_total=8, step_histograms=steps_of(5, 300, 2))))
    text = metrics.exposition().decode()
    assert 'pagoda_kv_cache_usage_ratio{model_name="m"} 0.25' in text
    assert 'pagoda_iteration_tokens_count{model_name="m"} 2.0' in text
    assert 'pagoda_iteration_tokens_bucket{le="8.0",model_name="m"} 1.0' in text
    assert 'pagoda_iteration_tokens_sum{model_name="m"} 305.0' in text
    # reading is not draining: a second read of the same engine state exports the same counts
    assert 'pagoda_iteration_tokens_count{model_name="m"} 2.0' in metrics.exposition().decode()
    # the next scrape sees the new snapshot: one more step, counted once
    text = metrics.exposition().decode()
    assert 'pagoda_kv_cache_usage_ratio{model_name="m"} 0.0' in text
    assert 'pagoda_iteration_tokens_count{model_name="m"} 3.0' in text
    assert 'pagoda_iteration_tokens_bucket{le="2.0",model_name="m"} 1.0' in text


def test_request_latencies_spread_each_outputs_gap_over_its_tokens():
    """Inter-token gaps follow sequence 0: an output of several tokens counts its gap split evenly,
    a first output of several tokens counts the gaps after its first; the rest once, at the end."""
    metrics = ServerMetrics("m")
    tracker = metrics.request_tracker()
    times = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.25, first_token_time=2.0, last_token_time=2.5)

    def output(tokens: list[int], finish_reason: str | None = None) -> RequestOutput:
        choice = CompletionOutput(0, "x" * len(tokens), tokens, None, None, finish_reason=finish_reason)
        return RequestOutput("r", "p", [1], [choice], finish_reason is not None, 0, times)

    tracker.update(output([5, 6, 7]))  # first output, 3 tokens from 2.0 to 2.5: two gaps of 0.25
    times.last_token_time = 2.515625
    tracker.update(output([8]))  # one gap of 1/64
    times.last_token_time = times.finished_time = 2.765625
    tracker.update(output([9, 10], "length"))  # two gaps of 1/8
    text = metrics.exposition().decode()

    def sample(name: str, value: float, le: str | None = None) -> str:
        bound = f'le="{le}",' if le else ""
        return f'pagoda_{name}{{{bound}model_name="m"}} {value!r}'

    assert sample("inter_token_latency_seconds_count", 5.0) in text
    assert sample("inter_token_latency_seconds_sum", 0.765625) in text
    for le, count in (("0.01", 0.0), ("0.02", 1.0), ("0.15", 3.0), ("0.2", 3.0), ("0.3", 5.0)):
        assert sample("inter_token_latency_seconds_bucket", count, le) in text
    assert sample("time_to_first_token_seconds_sum", 1.0) in text
    assert sample("request_queue_time_seconds_sum", 0.25) in text
    assert sample("e2e_request_latency_seconds_bucket", 0.0, "1.5") in text
    assert sample("e2e_request_latency_seconds_bucket", 1.0, "2.0") in text
    assert 'pagoda_requests_finished_total{finished_reason="length",model_name="m"} 1.0' in text
    tracker.finish("abort")  # once only
    assert 'finished_reason="abort",model_name="m"} 0.0' in metrics.exposition().decode()
