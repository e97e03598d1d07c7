"""vLLM-compatible metric names (`--vllm-compatible-metrics`): the same values under vLLM v1's names.

Tools written for vLLM pods (the Gateway API inference extension's endpoint picker, KEDA examples,
inference-perf, Grafana dashboards) query `vllm:*` names. Each scrape collects pagoda's families once
and re-emits the mapped ones under their vLLM name: same type, same samples, labels `model_name` and
`engine` (vLLM's engine index; one engine per pod here, so "0"). docs/metrics.md shows the table.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

ENGINE_INDEX = "0"

# pagoda family name -> vLLM family name (exposition adds `_total` to counters, as vLLM's do).
VLLM_NAMES = {
    "pagoda_num_requests_running": "vllm:num_requests_running",
    "pagoda_num_requests_waiting": "vllm:num_requests_waiting",
    "pagoda_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "pagoda_prompt_tokens": "vllm:prompt_tokens",
    "pagoda_generation_tokens": "vllm:generation_tokens",
    "pagoda_preemptions": "vllm:num_preemptions",
    "pagoda_prefix_cache_queries": "vllm:prefix_cache_queries",
    "pagoda_prefix_cache_hits": "vllm:prefix_cache_hits",
    "pagoda_requests_finished": "vllm:request_success",
    "pagoda_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pagoda_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pagoda_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pagoda_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "pagoda_iteration_tokens": "vllm:iteration_tokens_total",  # a histogram in vLLM, despite the name
}
ENGINE_INFO = "pagoda_engine_info"
CACHE_CONFIG_INFO = "vllm:cache_config_info"


def _renamed(family: Metric, name: str) -> Metric:
    renamed = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        suffix = sample.name[len(family.name) :]
        labels = {**sample.labels, "engine": ENGINE_INDEX}
        renamed.add_sample(renamed.name + suffix, labels, sample.value, sample.timestamp, sample.exemplar)
    return renamed


def _cache_config_info(family: Metric) -> Metric:
    """vLLM's cache config as labels (the endpoint picker reads block_size and num_gpu_blocks)."""
    info = GaugeMetricFamily(
        CACHE_CONFIG_INFO,
        "KV cache configuration (value is always 1).",
        labels=["model_name", "engine", "block_size", "num_gpu_blocks"],
    )
    for sample in family.samples:
        labels = sample.labels
        info.add_metric([labels["model_name"], ENGINE_INDEX, labels["block_size"], labels["num_blocks"]], 1)
    return info


def vllm_families(families: Iterable[Metric]) -> list[Metric]:
    """The vLLM-named copies of the mapped families among `families` (collected once per scrape)."""
    out = []
    for family in families:
        if family.name in VLLM_NAMES:
            out.append(_renamed(family, VLLM_NAMES[family.name]))
        elif family.name == ENGINE_INFO:
            out.append(_cache_config_info(family))
    return out
