"""--vllm-compatible-metrics: every vLLM name in docs/metrics.md is exported with its type and labels,
carries the same values as its pagoda twin, and a real Prometheus finds each one by `model_name`."""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path

import pytest
from pagoda.server import serve_cli
from pagoda.server.api.state import ServerConfig
from pagoda.server.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from pagoda.server.pod_metrics import ServerMetrics
from support.prometheus import PrometheusServer, prometheus_binary
from test_server_metrics_contract import steps_of
from test_server_prometheus import load

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
SUFFIXES = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}


def documented_vllm() -> dict[str, tuple[str, set[str], str]]:
    """exposition name -> (type, extra labels, pagoda twin), from the vLLM table."""
    rows = re.findall(
        r"^\| `(vllm:[a-z0-9_]+)` \| ([a-z]+) \|([^|]*)\| `(pagoda_[a-z0-9_]+)`", DOC.read_text(), flags=re.MULTILINE
    )
    return {name: (kind, set(re.findall(r"`([a-z_]+)`", labels)), twin) for name, kind, labels, twin in rows}


def family_name(exposition_name: str, kind: str) -> str:
    return exposition_name.removesuffix("_total") if kind == "counter" else exposition_name


def finished_output() -> RequestOutput:
    times = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0,
                           last_token_time=3.0, finished_time=3.0)  # fmt: skip
    choice = CompletionOutput(0, "ab", [5, 6, 7], None, None, finish_reason="length")
    return RequestOutput("r", "p", [1, 2], [choice], True, 0, times)


def scraped(vllm_compatible: bool) -> ServerMetrics:
    metrics = ServerMetrics("m", vllm_compatible=vllm_compatible)
    stats = EngineStats(num_running=2, num_waiting=3, num_blocks_total=10, num_blocks_used=4, block_size=16,
                        prompt_tokens=11, generation_tokens=7, preemptions=1, prefix_cache_queries=9,
                        prefix_cache_hits=4, step_histograms=steps_of(3, 70))  # fmt: skip
    metrics.attach(lambda: stats)
    metrics.request_tracker().update(finished_output())
    return metrics


def test_every_documented_vllm_name_is_exported_with_its_type_labels_and_values():
    table = documented_vllm()
    assert len(table) == 15
    families = {f.name: f for f in scraped(vllm_compatible=True).families()}
    exported = {name for name in families if name.startswith("vllm:")}
    assert exported == {family_name(name, kind) for name, (kind, _, _) in table.items()}
    for name, (kind, extra, twin) in table.items():
        family = families[family_name(name, kind)]
        assert family.type == kind, name
        names = {sample.name for sample in family.samples}
        assert {name.removesuffix("_total") + s if kind == "counter" else name + s for s in SUFFIXES[kind]} <= names
        for sample in family.samples:
            assert sample.labels["model_name"] == "m" and sample.labels["engine"] == "0", sample
            assert extra <= set(sample.labels), (name, sample.labels)
        if twin != "pagoda_engine_info":  # same samples as the twin, under the new name
            pagoda = families[family_name(twin, kind)]
            ours = sorted((s.name[len(pagoda.name):], sorted(s.labels.items()), s.value) for s in pagoda.samples)
            theirs = sorted(
                (s.name[len(family.name):], sorted((k, v) for k, v in s.labels.items() if k != "engine"), s.value)
                for s in family.samples
            )
            assert ours == theirs, name
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "10"
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == pytest.approx(0.4)


def test_off_by_default():
    assert b"vllm:" not in scraped(vllm_compatible=False).exposition()
    assert b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0' in scraped(True).exposition()


def test_flag_and_environment_variable(monkeypatch):
    def parse(*argv: str) -> bool:
        parser = argparse.ArgumentParser()
        serve_cli.add_arguments(parser)
        return parser.parse_args(list(argv)).vllm_compatible_metrics

    assert parse() is False and parse("--vllm-compatible-metrics") is True
    monkeypatch.setenv("PAGODA_VLLM_COMPATIBLE_METRICS", "true")
    assert parse() is True and parse("--no-vllm-compatible-metrics") is False


@pytest.mark.skipif(prometheus_binary() is None, reason="Debian's prometheus is not installed")
async def test_prometheus_finds_every_vllm_name_by_model_name(start_server, tmp_path):
    server = start_server(ServerConfig(served_model_name="tiny-vllm", vllm_compatible_metrics=True))
    model = "tiny-vllm"
    with PrometheusServer([server.url.removeprefix("http://")], tmp_path / "prometheus", scrape_interval=0.5) as prom:
        await asyncio.to_thread(prom.wait_for, "vllm:cache_config_info")
        await load(server.url, model)
        await asyncio.sleep(1.5)  # a scrape after the load
        for name, (kind, _, _) in documented_vllm().items():
            for suffix in SUFFIXES[kind] if kind == "histogram" else [""]:
                query = f'{name}{suffix}{{model_name="{model}"}}'
                assert await asyncio.to_thread(prom.wait_for, query, 10), query
        twins = prom.query('vllm:generation_tokens_total{model_name="tiny-vllm"}')[0]["value"][1]
        assert twins == prom.query('pagoda_generation_tokens_total{model_name="tiny-vllm"}')[0]["value"][1]
        assert float(twins) >= 7 * 80
        info = prom.query("vllm:cache_config_info")[0]["metric"]
        assert info["block_size"] == "16" and info["num_gpu_blocks"] == "64"
        assert float(prom.query("max_over_time(vllm:num_requests_running[2m])")[0]["value"][1]) >= 1
