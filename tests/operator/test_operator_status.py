"""status: pods and Deployment status → conditions, reasons, transition times, patches and Events."""

from __future__ import annotations

import pytest
from pagoda.operator import status
from pagoda.operator.render import Owner

OWNER = Owner("llm", "ml", "uid-1")
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def pod(name="p", phase="Running", containers=(), inits=(), conditions=()):
    return {
        "metadata": {"name": name},
        "status": {
            "phase": phase,
            "containerStatuses": list(containers),
            "initContainerStatuses": list(inits),
            "conditions": list(conditions),
        },
    }


def server(**fields):
    return {"name": "server", "restartCount": 0, **fields}


def deployment(replicas=1, ready=1, updated=1, generation=1, observed=1, conditions=()):
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": list(conditions),
        },
    }


@pytest.mark.parametrize(
    ("the_pod", "reason", "failing"),
    [
        (
            pod(
                phase="Pending",
                conditions=[
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes have nvidia.com/gpu",
                    }
                ],
            ),
            "Unschedulable",
            True,
        ),
        (
            pod(containers=[server(state={"waiting": {"reason": "ImagePullBackOff"}})]),
            "ImagePullBackOff",
            True,
        ),
        (pod(containers=[server(state={"waiting": {"reason": "ErrImagePull"}})]), "ImagePullBackOff", True),
        (
            pod(
                containers=[
                    server(
                        restartCount=3,
                        state={"waiting": {"reason": "CrashLoopBackOff"}},
                        lastState={"terminated": {"reason": "Error", "exitCode": 1}},
                    )
                ]
            ),
            "CrashLoopBackOff",
            True,
        ),
        (
            pod(
                containers=[
                    server(
                        state={
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "hf" not found',
                            }
                        }
                    )
                ]
            ),
            "CreateContainerConfigError",
            True,
        ),
        (
            pod(phase="Pending", inits=[{"name": "model-download", "state": {"running": {"startedAt": T0}}}]),
            "ModelDownloading",
            False,
        ),
        (
            pod(
                phase="Pending",
                inits=[
                    {
                        "name": "model-download",
                        "restartCount": 2,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 1}},
                    }
                ],
            ),
            "ModelDownloadFailed",
            True,
        ),
        (pod(containers=[server(ready=False, state={"running": {"startedAt": T0}})]), "ModelLoading", False),
        (pod(phase="Pending"), "PodStarting", False),
    ],
)
def test_pod_problem(the_pod, reason, failing):
    problem = status.pod_problem(the_pod)
    assert (problem.reason, problem.failing) == (reason, failing)
    assert the_pod["metadata"]["name"] in problem.message


def test_serving_and_leaving_pods_have_no_problem():
    assert status.pod_problem(pod(containers=[server(ready=True, state={"running": {}})])) is None
    leaving = pod(phase="Pending")
    leaving["metadata"]["deletionTimestamp"] = T0
    assert status.pod_problem(leaving) is None


def conditions_of(desired, obs):
    return {c["type"]: (c["status"], c["reason"]) for c in status.workload_conditions(desired, obs)}


def test_complete_rollout_is_ready():
    ready_pod = pod(containers=[server(ready=True, state={"running": {}})])
    assert conditions_of(1, status.Observation(deployment(), [ready_pod])) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }


def test_not_yet_observed_generation_is_still_rolling_out():
    got = conditions_of(1, status.Observation(deployment(generation=2, observed=1), []))
    assert got["Ready"] == ("False", "RollingOut") and got["Progressing"] == ("True", "RollingOut")


def test_failure_wins_over_progress_and_names_the_reason():
    crash = pod(containers=[server(state={"waiting": {"reason": "CrashLoopBackOff"}})])
    got = conditions_of(2, status.Observation(deployment(replicas=2, ready=1, updated=2), [crash]))
    assert got["Degraded"] == ("True", "CrashLoopBackOff") and got["Ready"] == ("False", "CrashLoopBackOff")


def test_stuck_rollout_and_refused_apply_degrade():
    stuck = deployment(
        ready=0,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "too slow",
            }
        ],
    )
    assert conditions_of(1, status.Observation(stuck, []))["Degraded"] == ("True", "ProgressDeadlineExceeded")
    refused = status.Observation(deployment(), [], apply_error="PVC spec is immutable")
    assert conditions_of(1, refused)["Degraded"] == ("True", "ApplyFailed")


def test_scaling_reasons_and_zero():
    assert conditions_of(1, status.Observation(deployment(replicas=2, ready=2, updated=2), []))[
        "Progressing"
    ] == ("True", "ScalingDown")
    assert conditions_of(3, status.Observation(deployment(replicas=3, ready=1, updated=3), []))[
        "Progressing"
    ] == ("True", "ScalingUp")
    assert conditions_of(0, status.Observation(deployment(replicas=0, ready=0, updated=0), []))["Ready"] == (
        "False",
        "ScaledToZero",
    )


def compute(obs, previous=None, now=T0, monitor="Created"):
    return status.compute_status(
        OWNER, {"replicas": 1}, obs, generation=4, now=now, previous=previous, service_monitor_state=monitor
    )


def test_status_fields_and_endpoint_only_when_serving():
    serving = compute(status.Observation(deployment(), []))
    assert serving["endpoint"] == "http://llm.ml.svc:8000/v1" and serving["ready"] == "1/1"
    assert (
        serving["selector"] == "app.kubernetes.io/component=inference,serving.pagoda.dev/inferenceservice=llm"
    )
    assert serving["observedGeneration"] == 4
    assert serving["model"] == "SmolLM2-135M-Instruct"  # no model in the spec: the embedded one
    assert all(c["observedGeneration"] == 4 for c in serving["conditions"])
    assert compute(status.Observation(deployment(ready=0), []))["endpoint"] is None


def test_unchanged_refresh_writes_nothing_and_keeps_transition_times():
    obs = status.Observation(deployment(), [])
    first = compute(obs)
    again = compute(obs, previous=first, now=T1, monitor=None)  # a refresh keeps the ServiceMonitor condition
    assert again == first and status.status_changes(again, first) == {}
    worse = compute(status.Observation(deployment(ready=0), []), previous=first, now=T1)
    ready = next(c for c in worse["conditions"] if c["type"] == "Ready")
    degraded = next(c for c in worse["conditions"] if c["type"] == "Degraded")
    assert ready["lastTransitionTime"] == T1 and degraded["lastTransitionTime"] == T0
    changes = status.status_changes(worse, first)
    assert changes["endpoint"] is None and "selector" not in changes  # None deletes it in a merge patch


def test_transitions_become_events():
    good = compute(status.Observation(deployment(), []))
    crash = pod(containers=[server(state={"waiting": {"reason": "CrashLoopBackOff"}})])
    bad = compute(status.Observation(deployment(ready=0), [crash]), previous=good)
    assert status.transitions(good["conditions"], []) == [("Normal", "Ready", "1/1 replicas ready")]
    kinds = {(kind, reason) for kind, reason, _ in status.transitions(bad["conditions"], good["conditions"])}
    assert kinds == {("Warning", "NotReady"), ("Warning", "CrashLoopBackOff")}
    assert status.transitions(bad["conditions"], bad["conditions"]) == []
    recovered = status.transitions(good["conditions"], bad["conditions"])
    assert ("Normal", "Recovered") in {(k, r) for k, r, _ in recovered}


def test_refused_apply_is_carried_until_a_reconcile_succeeds():
    refused = compute(status.Observation(deployment(), [], apply_error="immutable"))
    assert status.carried_apply_error(refused) == "immutable"
    assert status.carried_apply_error(compute(status.Observation(deployment(), []))) is None


@pytest.mark.parametrize(
    ("args", "query", "expected"),
    [
        (
            ("v1", "pods", "ml"),
            {"labelSelector": "a=b,c in (d)"},
            "/api/v1/namespaces/ml/pods?labelSelector=a%3Db%2Cc%20in%20%28d%29",
        ),
        (("apps/v1", "deployments", "ml", "llm"), {}, "/apis/apps/v1/namespaces/ml/deployments/llm"),
        (
            ("serving.pagoda.dev/v1alpha1", "inferenceservices", "ml", "llm", "status"),
            {},
            "/apis/serving.pagoda.dev/v1alpha1/namespaces/ml/inferenceservices/llm/status",
        ),
        (
            ("apiextensions.k8s.io/v1", "customresourcedefinitions"),
            {},
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        ),
    ],
)
def test_api_paths(args, query, expected):
    from pagoda.operator.kube import path

    assert path(*args, **query) == expected
