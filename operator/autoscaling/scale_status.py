"""What the autoscaler writes into `status`: `kvCache`, `autoscaling` (the decision explained), and the
stabilization history mirrored there so a restarted operator remembers its recent recommendations.

Status is written with JSON merge patches: maps merge, so keys that went away (pods that are gone)
must be sent as null to disappear; lists (the history) are replaced whole.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from pagoda.operator.autoscaling.collect import PodSample
from pagoda.operator.autoscaling.decision import Decision, Recommendation


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def kv_cache_status(samples: Mapping[str, PodSample | str], now: float) -> dict[str, Any] | None:
    """Mean usage over the pods that answered, total capacity; None when no pod answered."""
    answered = [s for s in samples.values() if isinstance(s, PodSample)]
    if not answered:
        return None
    status: dict[str, Any] = {"usage": round(sum(s.kv_cache_usage for s in answered) / len(answered), 4),
                              "updatedAt": iso(now)}
    if all(s.capacity_tokens is not None for s in answered):
        status["capacityTokens"] = sum(s.capacity_tokens or 0 for s in answered)
    first = answered[0]
    if first.block_size is not None:
        status["blockSize"] = first.block_size
    if first.num_blocks is not None:
        status["numBlocks"] = first.num_blocks
    return status


def pod_metrics(samples: Mapping[str, PodSample | str], not_ready: list[str]) -> dict[str, dict[str, Any]]:
    metrics: dict[str, dict[str, Any]] = {name: {"ready": False} for name in not_ready}
    for name, sample in samples.items():
        if isinstance(sample, PodSample):
            metrics[name] = {"ready": True, "kvCacheUsage": round(sample.kv_cache_usage, 4),
                             "waiting": sample.waiting, "running": sample.running}
        else:
            metrics[name] = {"ready": True, "error": sample[:200]}
    return metrics


def proposals(decision: Decision) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for metric, p in decision.proposals.items():
        entry: dict[str, Any] = {"target": p.target, "podsWithSample": p.pods_with_sample,
                                 "podsMissing": p.pods_missing, "note": p.note}
        if p.average is not None:
            entry["average"] = round(p.average, 4)
        if p.ratio is not None:
            entry["ratio"] = round(p.ratio, 4)
        if p.replicas is not None:
            entry["replicas"] = p.replicas
        out[metric] = entry
    return out


def history_to_status(history: tuple[Recommendation, ...]) -> list[dict[str, Any]]:
    return [{"time": iso(r.time), "replicas": r.replicas} for r in history]


def history_from_status(autoscaling_status: Mapping[str, Any] | None) -> tuple[Recommendation, ...]:
    entries = (autoscaling_status or {}).get("history") or []
    return tuple(Recommendation(from_iso(e["time"]), int(e["replicas"])) for e in entries)


def with_removals(new: dict[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any]:
    """A merge-patch map that also deletes the keys only `old` has."""
    return {**{k: None for k in (old or {}) if k not in new}, **new}


def pod_metrics_patch(new: dict[str, dict[str, Any]], old: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per pod too: a pod that answered after an error must lose its `error` (and the reverse)."""
    old = old or {}
    return {name: with_removals(entry, old.get(name) if isinstance(old.get(name), Mapping) else None)
            for name, entry in new.items()}


def autoscaling_status(decision: Decision, samples: Mapping[str, PodSample | str], not_ready: list[str],
                       previous: Mapping[str, Any] | None, scaled_at: float | None) -> dict[str, Any]:
    previous = previous or {}
    status: dict[str, Any] = {
        "desiredReplicas": decision.desired_replicas,
        "reason": decision.reason,
        "metrics": with_removals(pod_metrics_patch(pod_metrics(samples, not_ready), previous.get("metrics")),
                                 previous.get("metrics")),
        "proposals": with_removals(proposals(decision), previous.get("proposals")),
        "history": history_to_status(decision.history),
    }
    if scaled_at is not None:
        status["lastScaleTime"] = iso(scaled_at)
    return status
