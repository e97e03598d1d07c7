"""The Gateway API inference extension: an InferencePool over one InferenceService's serving pods.

A Gateway routes to the pool through its endpoint picker, which scrapes each pod's metrics and sends
a request to the pod with the shortest queue and the most free KV cache. The picker reads vLLM's
metric names by default (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:cache_config_info`, ...) for pods labelled `inference.networking.k8s.io/engine-type: vllm`,
so a pool turns on the pods' vLLM-compatible names and that label. Pure functions, used by render.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_KIND = "InferencePool"
POOL_PLURAL = "inferencepools"
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
ENGINE_TYPE = "vllm"  # the picker's metric mapping pagoda's vLLM-compatible names follow


def pool_wanted(spec: Mapping[str, Any]) -> bool:
    return bool(spec["routing"]["inferencePool"]["enabled"])


def vllm_metrics_wanted(spec: Mapping[str, Any]) -> bool:
    return bool(spec["monitoring"]["vllmCompatibleMetrics"]) or pool_wanted(spec)


def pod_labels(spec: Mapping[str, Any]) -> dict[str, str]:
    """Extra labels of the serving pods (the picker reads the engine type from them)."""
    return {ENGINE_TYPE_LABEL: ENGINE_TYPE} if pool_wanted(spec) else {}


def endpoint_picker_name(owner_name: str, spec: Mapping[str, Any]) -> str:
    return spec["routing"]["inferencePool"]["endpointPicker"].get("name") or f"{owner_name}-epp"


def inference_pool(metadata: dict[str, Any], selector: dict[str, str], port: int,
                   spec: Mapping[str, Any]) -> dict[str, Any]:
    """The pool: `selector` matches exactly the serving pods (the Deployment's own selector)."""
    picker = spec["routing"]["inferencePool"]["endpointPicker"]
    return {
        "apiVersion": POOL_API_VERSION, "kind": POOL_KIND, "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"group": "", "kind": "Service",
                                  "name": endpoint_picker_name(metadata["name"], spec),
                                  "port": {"number": picker["port"]}, "failureMode": picker["failureMode"]},
        },
    }
