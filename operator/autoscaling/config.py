"""`spec.autoscaling` → the decision's Policy and the collector's settings.

The section is defaulted with the CRD schema's own defaults (`crd.with_defaults`), so no default is
restated here: a missing field means what the API server would have filled in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.operator import crd
from pagoda.operator.autoscaling.decision import KV_CACHE_USAGE, QUEUE_DEPTH, Policy

AUTOSCALING_SCHEMA = crd.SPEC["properties"]["autoscaling"]


def defaulted(autoscaling: Mapping[str, Any] | None) -> dict[str, Any]:
    return crd.with_defaults(dict(autoscaling or {}), AUTOSCALING_SCHEMA)


@dataclass(frozen=True)
class Collection:
    interval_s: float
    scrape_timeout_s: float
    prometheus_url: str | None = None


def collection_from_spec(autoscaling: Mapping[str, Any] | None) -> Collection:
    a = defaulted(autoscaling)
    return Collection(interval_s=float(a["intervalSeconds"]), scrape_timeout_s=float(a["scrapeTimeoutSeconds"]),
                      prometheus_url=a.get("prometheusURL") or None)


def policy_from_spec(autoscaling: Mapping[str, Any] | None) -> Policy:
    a = defaulted(autoscaling)
    return Policy(
        min_replicas=int(a["minReplicas"]),
        max_replicas=int(a.get("maxReplicas", a["minReplicas"])),  # no default: the CRD requires it when enabled
        targets={KV_CACHE_USAGE: float(a["targetKVCacheUsage"]), QUEUE_DEPTH: float(a["targetQueueDepth"])},
        tolerance=float(a["tolerance"]),
        scale_up_stabilization_s=float(a["scaleUpStabilizationSeconds"]),
        scale_down_stabilization_s=float(a["scaleDownStabilizationSeconds"]),
        scale_up_max_pods_per_step=int(a["scaleUpMaxPodsPerStep"]),
        scale_up_max_percent_per_step=float(a["scaleUpMaxPercentPerStep"]),
    )
