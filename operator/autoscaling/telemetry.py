"""The autoscaler's operator metrics (default prometheus_client registry, served by `pagoda operator`
on --metrics-port with the rest of the `pagoda_operator_*` metrics)."""

from __future__ import annotations

from pagoda.operator.autoscaling.decision import Decision
from prometheus_client import Counter, Gauge

SCALE_DECISIONS = Counter(
    "pagoda_operator_scale_decisions",
    "Autoscaler decisions by direction (up, down, none).",
    ["direction"],
)
DESIRED_REPLICAS = Gauge(
    "pagoda_operator_desired_replicas",
    "Replicas the autoscaler last decided for an InferenceService.",
    ["namespace", "name"],
)


def record(namespace: str, name: str, decision: Decision) -> None:
    SCALE_DECISIONS.labels(decision.direction).inc()
    DESIRED_REPLICAS.labels(namespace, name).set(decision.desired_replicas)
