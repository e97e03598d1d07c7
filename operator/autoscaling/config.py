"""`spec.autoscaling` → the decision's Policy and the collector's settings (defaults as in the CRD)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.operator.autoscaling.decision import KV_CACHE_USAGE, QUEUE_DEPTH, Policy


@dataclass(frozen=True)
class Collection:
    interval_s: float = 15.0
    scrape_timeout_s: float = 2.0
    prometheus_url: str | None = None


def collection_from_spec(autoscaling: Mapping[str, Any] | None) -> Collection:
    a = autoscaling or {}
    return Collection(interval_s=float(a.get("intervalSeconds", 15)),
                      scrape_timeout_s=float(a.get("scrapeTimeoutSeconds", 2)),
                      prometheus_url=a.get("prometheusURL") or None)


def policy_from_spec(autoscaling: Mapping[str, Any] | None) -> Policy:
    a = autoscaling or {}
    min_replicas = int(a.get("minReplicas", 1))
    return Policy(
        min_replicas=min_replicas,
        max_replicas=int(a.get("maxReplicas", min_replicas)),  # the CRD requires it when enabled
        targets={KV_CACHE_USAGE: float(a.get("targetKVCacheUsage", 0.7)),
                 QUEUE_DEPTH: float(a.get("targetQueueDepth", 4))},
        tolerance=float(a.get("tolerance", 0.1)),
        scale_up_stabilization_s=float(a.get("scaleUpStabilizationSeconds", 0)),
        scale_down_stabilization_s=float(a.get("scaleDownStabilizationSeconds", 300)),
        scale_up_max_pods_per_step=int(a.get("scaleUpMaxPodsPerStep", 4)),
        scale_up_max_percent_per_step=float(a.get("scaleUpMaxPercentPerStep", 100)),
    )
