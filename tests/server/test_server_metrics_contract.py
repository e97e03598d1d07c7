"""docs/metrics.md is a contract: the names it lists and the names a server exports must agree."""

from __future__ import annotations

import re
from pathlib import Path

from pagoda.server.engine.outputs import EngineStats
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
    assert len(families) == 30
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
