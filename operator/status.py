"""Observed Deployment + Pods → InferenceService status and conditions. Pure: the clock is an argument.

Conditions (metav1.Condition shape):
- Ready: every desired replica runs the current template and passes /ready.
- Progressing: a rollout, a scale or a model download/load is under way.
- Degraded: something needs a human or costs capacity: image pull, crash loop, a server restarted
  and not ready yet, unschedulable pod, failed download, config error, stuck rollout, or children
  the API refused.
- ServiceMonitor: whether the ServiceMonitor exists, and why not.
- InferencePool (only when spec.routing.inferencePool asks): whether the pool exists, and why not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.operator import crd
from pagoda.operator import leaderworkerset as lws
from pagoda.operator.render import (
    DOWNLOAD_CONTAINER,
    SERVER_CONTAINER,
    Owner,
    endpoint,
    selector_string,
)
from pagoda.operator.weights import client_model_name

PULL_FAILURES = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_FAILURES = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class PodProblem:
    """The most telling thing about one pod that is not serving yet."""

    reason: str
    message: str
    failing: bool  # True: needs a human (Degraded); False: just not there yet (Progressing)


def _waiting(status: Mapping[str, Any]) -> Mapping[str, Any]:
    return (status.get("state") or {}).get("waiting") or {}


def _last_exit(status: Mapping[str, Any]) -> str:
    term = (status.get("lastState") or {}).get("terminated") or {}
    if not term:
        return ""
    return f" (last exit: {term.get('reason') or 'Error'}, code {term.get('exitCode', '?')})"


def _download_failure(init: Mapping[str, Any]) -> str:
    """The download's own words (its last log line, the kubelet's termination message), else its exit."""
    term = (init.get("state") or {}).get("terminated") or (init.get("lastState") or {}).get("terminated") or {}
    lines = [line.strip() for line in str(term.get("message") or "").splitlines() if line.strip()]
    if lines:
        return lines[-1][:500]
    return f"the model download keeps failing{_last_exit(init)}"


def pod_problem(pod: Mapping[str, Any]) -> PodProblem | None:
    """Why this pod is not serving, read from its phase, conditions and container statuses."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return None  # leaving: not a problem of the current state
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            reason = cond.get("reason") or "Unschedulable"
            return PodProblem(reason, f"pod {name}: {cond.get('message', 'cannot be scheduled')}",
                              failing=reason == "Unschedulable")
    for init in status.get("initContainerStatuses") or []:
        waiting = _waiting(init)
        if waiting.get("reason") in PULL_FAILURES:
            return PodProblem("ImagePullBackOff", f"pod {name}: {waiting.get('message') or waiting['reason']}",
                              failing=True)
        if waiting.get("reason") in CONFIG_FAILURES:
            return PodProblem(waiting["reason"], f"pod {name}: {waiting.get('message') or waiting['reason']}",
                              failing=True)
        if init.get("name") == DOWNLOAD_CONTAINER:
            failed_now = ((init.get("state") or {}).get("terminated") or {}).get("exitCode", 0) != 0
            retrying = "terminated" not in (init.get("state") or {}) and (
                waiting.get("reason") == "CrashLoopBackOff" or init.get("restartCount", 0) > 0)
            if failed_now or retrying:
                return PodProblem("ModelDownloadFailed", f"pod {name}: {_download_failure(init)}", failing=True)
            if "running" in (init.get("state") or {}):
                return PodProblem("ModelDownloading", f"pod {name}: downloading the model", failing=False)
    for container in status.get("containerStatuses") or []:
        if container.get("name") != SERVER_CONTAINER:
            continue
        waiting = _waiting(container)
        reason = waiting.get("reason")
        if reason in PULL_FAILURES:
            return PodProblem("ImagePullBackOff", f"pod {name}: {waiting.get('message') or reason}", failing=True)
        if reason == "CrashLoopBackOff":
            return PodProblem("CrashLoopBackOff",
                              f"pod {name}: the server keeps crashing{_last_exit(container)}, "
                              f"{container.get('restartCount', 0)} restarts", failing=True)
        if reason in CONFIG_FAILURES:
            return PodProblem(reason, f"pod {name}: {waiting.get('message') or reason}", failing=True)
        running = "running" in (container.get("state") or {})
        if running and not container.get("ready") and (container.get("lastState") or {}).get("terminated"):
            # Restarted in place (killed, OOM, a dead engine loop): capacity is lost until it is ready.
            return PodProblem("ServerRestarted",
                              f"pod {name}: the server exited{_last_exit(container)} and was restarted "
                              f"({container.get('restartCount', 0)} restarts); not serving until it is ready",
                              failing=True)
        if running and not container.get("ready"):
            return PodProblem("ModelLoading", f"pod {name}: the server is loading the model", failing=False)
    if status.get("phase") in (None, "Pending"):
        return PodProblem("PodStarting", f"pod {name}: starting", failing=False)
    return None


def _deployment_stuck(deployment: Mapping[str, Any]) -> str | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return cond.get("message") or "the rollout made no progress within its deadline"
    return None


def condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def with_transition_times(new: Iterable[dict[str, Any]], old: Iterable[Mapping[str, Any]], now: str,
                          generation: int) -> list[dict[str, Any]]:
    """Keep lastTransitionTime of conditions whose status did not change (no churn, honest times)."""
    previous = {c.get("type"): c for c in old}
    result = []
    for cond in new:
        before = previous.get(cond["type"])
        changed = before is None or before.get("status") != cond["status"]
        result.append({**cond, "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
                       "observedGeneration": generation})
    return result


@dataclass(frozen=True)
class Observation:
    """What the operator read from the cluster for one InferenceService."""

    deployment: Mapping[str, Any] | None
    pods: list[Mapping[str, Any]]
    apply_error: str | None = None  # the API refused a child (message)


def workload_conditions(desired: int, obs: Observation) -> list[dict[str, str]]:
    """Ready, Progressing, Degraded from the Deployment's status and the pods."""
    dep_status = (obs.deployment or {}).get("status") or {}
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    total = int(dep_status.get("replicas") or 0)
    dep_generation = (obs.deployment or {}).get("metadata", {}).get("generation", 0)
    caught_up = obs.deployment is not None and dep_status.get("observedGeneration", 0) >= dep_generation
    complete = caught_up and ready >= desired and updated >= desired and total <= desired
    problems = [p for p in map(pod_problem, obs.pods) if p is not None]
    failures = [p for p in problems if p.failing]
    stuck = _deployment_stuck(obs.deployment or {})

    if obs.apply_error:
        degraded = condition("Degraded", True, "ApplyFailed", obs.apply_error)
    elif failures:
        degraded = condition("Degraded", True, failures[0].reason, failures[0].message)
    elif stuck:
        degraded = condition("Degraded", True, "ProgressDeadlineExceeded", stuck)
    else:
        degraded = condition("Degraded", False, "AsExpected", "no failures observed")

    counts = f"{ready}/{desired} replicas ready"
    if obs.deployment is None:
        progressing = condition("Progressing", True, "Creating", "the Deployment is being created")
    elif complete:
        progressing = condition("Progressing", False, "RolloutComplete", counts)
    elif problems and not problems[0].failing:
        progressing = condition("Progressing", True, problems[0].reason, f"{problems[0].message}; {counts}")
    elif total > desired:
        progressing = condition("Progressing", True, "ScalingDown", counts)
    elif updated < desired or not caught_up:
        progressing = condition("Progressing", True, "RollingOut", f"{updated}/{desired} pods updated; {counts}")
    else:
        progressing = condition("Progressing", True, "ScalingUp", counts)

    if desired == 0:
        ready_cond = condition("Ready", False, "ScaledToZero", "spec.replicas is 0")
    elif complete:
        ready_cond = condition("Ready", True, "AllReplicasReady", counts)
    elif degraded["status"] == "True":
        ready_cond = condition("Ready", False, degraded["reason"], f"{degraded['message']}; {counts}")
    else:
        ready_cond = condition("Ready", False, progressing["reason"], progressing["message"])
    return [ready_cond, progressing, degraded]


# Optional children: condition type -> state -> (status, message); None: no condition in that state.
OPTIONAL_CHILD_MESSAGES: dict[str, dict[str, tuple[str, str] | None]] = {
    "ServiceMonitor": {
        "Created": ("True", "the ServiceMonitor selects the Service's http port"),
        "Disabled": ("False", "spec.monitoring.serviceMonitor is false"),
        "CRDNotFound": ("False", "monitoring.coreos.com/v1 ServiceMonitor is not served by this cluster "
                                 "(install the Prometheus Operator CRDs); skipped"),
    },
    "LeaderWorkerSet": {
        "Created": ("True", "each replica is a LeaderWorkerSet group of spec.parallelism.nodes pods"),
        "Disabled": None,  # one node per replica: a Deployment
        "CRDNotFound": ("False", "leaderworkerset.x-k8s.io/v1 LeaderWorkerSet is not served by this cluster "
                                 "(install LeaderWorkerSet); spec.parallelism.nodes > 1 needs it: nothing "
                                 "runs"),
    },
    "InferencePool": {
        "Created": ("True", "the InferencePool selects the serving pods' port 8000 for the endpoint picker"),
        "Disabled": None,  # not asked for: nothing to report
        "CRDNotFound": ("False", "inference.networking.k8s.io/v1 InferencePool is not served by this cluster "
                                 "(install the Gateway API inference extension CRDs); skipped"),
    },
}


def optional_child_condition(kind: str, state: str) -> dict[str, str] | None:
    entry = OPTIONAL_CHILD_MESSAGES[kind][state]
    if entry is None:
        return None
    status, message = entry
    return {"type": kind, "status": status, "reason": state, "message": message}


def compute_status(owner: Owner, spec: Mapping[str, Any], obs: Observation, *, generation: int, now: str,
                   previous: Mapping[str, Any] | None, service_monitor_state: str | None,
                   inference_pool_state: str | None = None,
                   leader_worker_set_state: str | None = None) -> dict[str, Any]:
    """The operator-owned part of status (kvCache and autoscaling are the autoscaler's).

    A None `*_state` means this pass did not look (status refresh): the previous condition is kept.
    """
    previous = previous or {}
    desired = int(spec.get("replicas", 1))
    dep_status = (obs.deployment or {}).get("status") or {}
    ready = int(dep_status.get("readyReplicas") or 0)
    conditions = workload_conditions(desired, obs)
    old_conditions = previous.get("conditions") or []
    for kind, state in (("ServiceMonitor", service_monitor_state), ("InferencePool", inference_pool_state),
                        ("LeaderWorkerSet", leader_worker_set_state)):
        if state is not None:
            conditions += [c for c in [optional_child_condition(kind, state)] if c is not None]
        else:
            conditions += [{k: v for k, v in c.items() if k not in ("lastTransitionTime", "observedGeneration")}
                           for c in old_conditions if c.get("type") == kind]
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": ready,
        "updatedReplicas": int(dep_status.get("updatedReplicas") or 0),
        "ready": f"{ready}/{desired}",
        "selector": selector_string(owner),
        "endpoint": endpoint(owner) if ready > 0 else None,
        "model": client_model_name(spec),
        "group": group_description(spec),
        "conditions": with_transition_times(conditions, old_conditions, now, generation),
    }
    return status


def group_description(spec: Mapping[str, Any]) -> str:
    """One replica in words, for `kubectl get -o wide` (e.g. "2 nodes × 8 GPUs, TP 16")."""
    spec = crd.with_defaults(dict(spec))
    nodes, gpus = lws.nodes(spec), int(spec["resources"]["gpus"])
    pods = f"{nodes} nodes × " if nodes > 1 else ""
    devices = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "CPU"
    return f"{pods}{devices}, TP {lws.tensor_parallel_size(spec)}"


def status_changes(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any]:
    """The merge patch that turns `old` into `new` for the keys we own (empty: nothing to write)."""
    old = old or {}
    return {key: value for key, value in new.items() if old.get(key) != value
            and not (value is None and key not in old)}


def transitions(new: Iterable[Mapping[str, Any]], old: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """Events worth posting: (type Normal|Warning, reason, message) for Ready/Degraded changes."""
    before = {c.get("type"): c for c in old}
    events = []
    for cond in new:
        prior = before.get(cond["type"])
        same = prior is not None and prior.get("status") == cond["status"] and prior.get("reason") == cond["reason"]
        if same:
            continue
        if cond["type"] == "Ready" and cond["status"] == "True":
            events.append(("Normal", "Ready", cond["message"]))
        elif cond["type"] == "Ready" and prior is not None and prior.get("status") == "True":
            events.append(("Warning", "NotReady", f"{cond['reason']}: {cond['message']}"))
        elif cond["type"] == "Degraded" and cond["status"] == "True":
            events.append(("Warning", cond["reason"], cond["message"]))
        elif cond["type"] == "Degraded" and prior is not None and prior.get("status") == "True":
            events.append(("Normal", "Recovered", cond["message"]))
        elif cond["type"] in OPTIONAL_CHILD_MESSAGES and cond["reason"] == "CRDNotFound":
            events.append(("Warning", f"{cond['type']}Skipped", cond["message"]))
    return events


def carried_apply_error(previous: Mapping[str, Any]) -> str | None:
    """A refused apply stays reported until a reconcile succeeds (status refreshes do not clear it)."""
    for cond in previous.get("conditions") or []:
        if cond.get("type") == "Degraded" and cond.get("reason") == "ApplyFailed":
            return cond.get("message")
    return None
