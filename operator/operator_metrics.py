"""The operator's own Prometheus metrics (`pagoda_operator_*`), served by `pagoda operator --metrics-port`."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

RECONCILES = Counter("pagoda_operator_reconciles", "InferenceService reconciles, by result (success, error).",
                     ["result"])
ERRORS = Counter("pagoda_operator_errors", "Errors in operator handlers, by stage (apply, status, autoscale).",
                 ["stage"])
SCALE_DECISIONS = Counter("pagoda_operator_scale_decisions",
                          "Autoscaler decisions that changed spec.replicas, by direction (up, down).",
                          ["namespace", "name", "direction"])
DESIRED_REPLICAS = Gauge("pagoda_operator_desired_replicas",
                         "Replicas the operator wants per InferenceService (spec.replicas).",
                         ["namespace", "name"])
