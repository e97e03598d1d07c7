"""Pod objects → who can be scraped, where: readiness as the Service sees it, the metrics URL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.operator.autoscaling.collect import DEFAULT_METRICS_PORT, METRICS_PORT_ANNOTATION, PodTarget


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready as an Endpoints controller counts it: Running, Ready=True, has an IP, not terminating."""
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    if not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def metrics_port(pod: Mapping[str, Any]) -> int:
    """The annotation if set (the local e2e harness: every pod on 127.0.0.1), else the port named http."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    if METRICS_PORT_ANNOTATION in annotations:
        return int(annotations[METRICS_PORT_ANNOTATION])
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return DEFAULT_METRICS_PORT


def scrape_target(pod: Mapping[str, Any]) -> PodTarget:
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    return PodTarget(pod["metadata"]["name"], f"http://{host}:{metrics_port(pod)}/metrics")


def live_pods(pods: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pods that count towards the replicas: terminating and finished ones do not (as the HPA)."""
    return [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
