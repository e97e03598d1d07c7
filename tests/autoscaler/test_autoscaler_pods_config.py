"""Pod objects → readiness and scrape URLs; spec.autoscaling → policy; status merge-patch helpers."""

from __future__ import annotations

from typing import Any

import pytest
from pagoda.operator import crd
from pagoda.operator.autoscaling.config import collection_from_spec, policy_from_spec
from pagoda.operator.autoscaling.decision import KV_CACHE_USAGE, QUEUE_DEPTH, Decision, Policy, Recommendation
from pagoda.operator.autoscaling.pods import is_ready, live_pods, scrape_target
from pagoda.operator.autoscaling.scale_status import history_from_status, history_to_status, with_removals


def pod(
    name: str = "p",
    *,
    phase: str = "Running",
    ready: str = "True",
    ip: str | None = "10.0.0.7",
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
    ports: list[Any] | None = None,
) -> dict:
    meta: dict[str, Any] = {"name": name, "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    return {
        "metadata": meta,
        "status": status,
        "spec": {
            "containers": [
                {
                    "name": "server",
                    "ports": ports if ports is not None else [{"name": "http", "containerPort": 8000}],
                }
            ]
        },
    }


@pytest.mark.parametrize(
    ("obj", "ready"),
    [
        (pod(), True),
        (pod(ready="False"), False),
        (pod(phase="Pending"), False),
        (pod(ip=None), False),
        (pod(deleting=True), False),
    ],
)
def test_ready_as_endpoints_count_it(obj: dict, ready: bool) -> None:
    assert is_ready(obj) is ready


def test_scrape_targets() -> None:
    assert scrape_target(pod()).url == "http://10.0.0.7:8000/metrics"
    assert (
        scrape_target(pod(ports=[{"name": "http", "containerPort": 9000}])).url
        == "http://10.0.0.7:9000/metrics"
    )
    annotated = pod(ip="127.0.0.1", annotations={"serving.pagoda.dev/metrics-port": "41234"})
    assert scrape_target(annotated).url == "http://127.0.0.1:41234/metrics"
    assert scrape_target(pod(ip="fd00::7")).url == "http://[fd00::7]:8000/metrics"


def test_live_pods_skip_terminating_and_finished() -> None:
    pods = [
        pod("a"),
        pod("b", deleting=True),
        pod("c", phase="Succeeded"),
        pod("d", phase="Failed"),
        pod("e", phase="Pending"),
    ]
    assert [p["metadata"]["name"] for p in live_pods(pods)] == ["a", "e"]


def test_policy_defaults_and_overrides() -> None:
    crd_default = crd.section_defaults("autoscaling")  # the one definition: the CRD schema's defaults
    default = policy_from_spec({"enabled": True, "maxReplicas": 5})
    assert default == Policy(max_replicas=5)  # a bare Policy carries the same defaults
    assert (default.min_replicas, default.max_replicas, default.tolerance) == (
        crd_default["minReplicas"], 5, crd_default["tolerance"])
    assert default.targets == {KV_CACHE_USAGE: crd_default["targetKVCacheUsage"],
                               QUEUE_DEPTH: crd_default["targetQueueDepth"]}
    assert (default.scale_up_stabilization_s, default.scale_down_stabilization_s) == (
        crd_default["scaleUpStabilizationSeconds"], crd_default["scaleDownStabilizationSeconds"])
    custom = policy_from_spec(
        {
            "minReplicas": 2,
            "maxReplicas": 8,
            "targetKVCacheUsage": 0.5,
            "targetQueueDepth": 2,
            "scaleDownStabilizationSeconds": 30,
            "scaleUpMaxPodsPerStep": 1,
            "scaleUpMaxPercentPerStep": 50,
        }
    )
    assert custom.targets == {KV_CACHE_USAGE: 0.5, QUEUE_DEPTH: 2.0}
    assert (custom.scale_down_stabilization_s, custom.scale_up_max_pods_per_step) == (30, 1)
    collection = collection_from_spec({"intervalSeconds": 5, "prometheusURL": "http://prom:9090"})
    assert (collection.interval_s, collection.scrape_timeout_s, collection.prometheus_url) == (
        5,
        crd_default["scrapeTimeoutSeconds"],
        "http://prom:9090",
    )


def test_history_round_trips_through_status_and_gone_pods_are_deleted() -> None:
    history = (Recommendation(1_795_000_000.0, 3), Recommendation(1_795_000_015.0, 2))
    status = {"history": history_to_status(history)}
    assert history_from_status(status) == history
    assert history_from_status(None) == ()
    # merge patch: a pod that is gone must be sent as null, or the stored map keeps it forever
    assert with_removals({"b": {"ready": True}}, {"a": {"ready": True}, "b": {}}) == {
        "a": None,
        "b": {"ready": True},
    }


def test_decision_direction() -> None:
    def d(current: int, desired: int) -> Decision:
        return Decision(current, desired, None, None, {}, "", ())

    assert [d(2, 3).direction, d(3, 2).direction, d(2, 2).direction] == ["up", "down", "none"]
