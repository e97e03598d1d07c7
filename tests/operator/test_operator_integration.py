"""The real kopf operator against the Kube emulator over HTTP: children, updates, status, restarts."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import kmock
import pytest
from operator_harness import (
    CR,
    CR_URL,
    DEP,
    NS,
    PDB,
    PODS_URL,
    PVC,
    SM,
    SVC,
    condition,
    create,
    events,
    eventually,
    isvc,
    live,
    patch,
    prepare_cluster,
    running_operator,
    server_pod,
    set_deployment_status,
    settled,
)
from pagoda.operator import render
from prometheus_client import REGISTRY
from support.kube_emulator import KubeEmulator

DEP_RESOURCE = kmock.resource(DEP)
pytestmark = [pytest.mark.kmock(cls=KubeEmulator), pytest.mark.timeout(120)]


def env_of(deployment: dict) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def template_hash(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["annotations"][render.TEMPLATE_HASH_ANNOTATION]


@pytest.fixture
def k8s(kmock, tmp_path, monkeypatch):
    prepare_cluster(kmock, tmp_path, monkeypatch)
    return kmock


async def test_create_makes_owned_children(k8s, caplog):
    caplog.set_level(logging.INFO)  # the operator's default level (at DEBUG kopf logs bodies: documented)
    successes = REGISTRY.get_sample_value("pagoda_operator_reconciles_total", {"result": "success"}) or 0
    async with running_operator(k8s):
        cr = await create(
            k8s,
            isvc(replicas=2, model={"uri": "hf://org/model@v1", "hfTokenSecretRef": {"name": "hf-secret"}}),
        )
        uid = cr["metadata"]["uid"]
        for resource in (DEP, SVC, PVC, PDB, SM):
            obj = await eventually(
                lambda r=resource: live(k8s, r, "llm" if r != PVC else "llm-weights"),
                what=f"{resource} created",
            )
            owner = obj["metadata"]["ownerReferences"][0]
            assert (owner["uid"], owner["kind"], owner["controller"]) == (uid, "InferenceService", True)
        dep = live(k8s, DEP, "llm")
        assert dep["spec"]["replicas"] == 2
        assert env_of(dep)["PAGODA_MODEL"] == "/models/hf/org/model/v1"
        assert dep["spec"]["template"]["spec"]["initContainers"][0]["name"] == "model-download"
        assert live(k8s, SVC, "llm")["spec"]["ports"][0] == {
            "name": "http",
            "port": 8000,
            "targetPort": "http",
            "protocol": "TCP",
        }
        await eventually(lambda: condition(k8s, "llm", "ServiceMonitor")["reason"] == "Created")
        status = live(k8s, CR, "llm")["status"]
        assert status["selector"] == render.selector_string(render.Owner("llm", NS, uid))
        assert status["observedGeneration"] == 1 and status["ready"] == "0/2"
        assert "endpoint" not in status  # nothing serves yet
        # the token's Secret is referenced by the pod only: not in status, not in events
        assert "hf-secret" not in str(status) and "hf-secret" not in str(events(k8s))
        # the status patch lands before the handler returns: its log line and counter follow it
        await eventually(lambda: "Handler 'reconcile' succeeded" in caplog.text, what="reconcile logged")
        assert "hf-secret" not in caplog.text  # ... and the log never names the Secret
        await eventually(
            lambda: REGISTRY.get_sample_value("pagoda_operator_reconciles_total", {"result": "success"}) > successes,
            what="reconcile counted",
        )
        assert (
            REGISTRY.get_sample_value("pagoda_operator_desired_replicas", {"namespace": NS, "name": "llm"})
            == 2
        )
        # deleting the InferenceService garbage-collects every child
        await k8s.delete(f"{CR_URL}/llm")
        await eventually(
            lambda: all(
                k8s.objects[r, NS, n].deleted
                for r, n in ((DEP, "llm"), (SVC, "llm"), (PVC, "llm-weights"), (PDB, "llm"), (SM, "llm"))
            )
        )


async def test_spec_changes_roll_autoscaling_and_scale_do_not(k8s):
    async with running_operator(k8s):
        await create(k8s, isvc(replicas=2))
        first = await eventually(lambda: live(k8s, DEP, "llm"))
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"engine": {"blockSize": 32}}})
        rolled = await eventually(
            lambda: (d := live(k8s, DEP, "llm")) and env_of(d)["PAGODA_BLOCK_SIZE"] == "32" and d,
            what="block size applied",
        )
        assert template_hash(rolled) != template_hash(first)
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"autoscaling": {"targetKVCacheUsage": 0.5}}})
        await eventually(lambda: live(k8s, CR, "llm")["status"]["observedGeneration"] == 3)
        assert template_hash(live(k8s, DEP, "llm")) == template_hash(rolled)
        # kubectl scale / HPA / the autoscaler: through the scale subresource of the InferenceService
        await patch(k8s, f"{CR_URL}/llm/scale", {"spec": {"replicas": 1}})
        await eventually(lambda: live(k8s, DEP, "llm")["spec"]["replicas"] == 1, what="scaled")
        assert template_hash(live(k8s, DEP, "llm")) == template_hash(rolled)
        await eventually(lambda: k8s.objects[PDB, NS, "llm"].deleted, what="PDB removed at 1 replica")


async def test_ready_pods_make_it_ready_with_endpoint(k8s):
    async with running_operator(k8s):
        await create(k8s, isvc(model={"uri": "file:///weights/model"}))
        dep = await eventually(lambda: live(k8s, DEP, "llm"))
        loading = server_pod(dep, "llm-a", {"ready": False, "started": False, "state": {"running": {}}})
        await k8s.post(PODS_URL, json=loading)
        await eventually(lambda: condition(k8s, "llm", "Progressing")["reason"] == "ModelLoading")
        await patch(
            k8s,
            f"{PODS_URL}/llm-a/status",
            {
                "status": {
                    "containerStatuses": [
                        {
                            "name": "server",
                            "ready": True,
                            "started": True,
                            "restartCount": 0,
                            "state": {"running": {}},
                        }
                    ]
                }
            },
        )
        await set_deployment_status(
            k8s, "llm", replicas=1, readyReplicas=1, updatedReplicas=1, availableReplicas=1
        )
        ready = await eventually(
            lambda: condition(k8s, "llm", "Ready")["status"] == "True" and condition(k8s, "llm", "Ready"),
            what="Ready",
        )
        assert ready["reason"] == "AllReplicasReady"
        status = live(k8s, CR, "llm")["status"]
        assert status["endpoint"] == f"http://llm.{NS}.svc:8000/v1" and status["ready"] == "1/1"
        assert status["model"] == "model"  # what clients send: the uri's last part
        assert condition(k8s, "llm", "Degraded")["status"] == "False"
        await eventually(
            lambda: any(e["reason"] == "Ready" and e["type"] == "Normal" for e in events(k8s)),
            what="Ready event",
        )
        await asyncio.sleep(0.5)  # a few more status refreshes: nothing changes, nothing is posted again
        assert [e["reason"] for e in events(k8s)].count("Ready") == 1


async def test_crash_looping_pod_degrades_with_reason(k8s):
    async with running_operator(k8s):
        await create(k8s, isvc(model={"uri": "pvc://models/llama"}))
        dep = await eventually(lambda: live(k8s, DEP, "llm"))
        crashing = server_pod(
            dep,
            "llm-b",
            {
                "ready": False,
                "restartCount": 4,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
            },
        )
        await k8s.post(PODS_URL, json=crashing)
        degraded = await eventually(
            lambda: (
                condition(k8s, "llm", "Degraded")["status"] == "True" and condition(k8s, "llm", "Degraded")
            ),
            what="Degraded",
        )
        assert degraded["reason"] == "CrashLoopBackOff" and "OOMKilled" in degraded["message"]
        assert condition(k8s, "llm", "Ready")["reason"] == "CrashLoopBackOff"
        await eventually(
            lambda: any(e["reason"] == "CrashLoopBackOff" and e["type"] == "Warning" for e in events(k8s)),
            what="warning event",
        )


async def test_restart_writes_nothing_new(k8s):
    async with running_operator(k8s):
        await create(k8s, isvc(replicas=2))
        await eventually(lambda: condition(k8s, "llm", "ServiceMonitor"))
        await eventually(lambda: live(k8s, PDB, "llm"))
    children = [(DEP, "llm"), (SVC, "llm"), (PVC, "llm-weights"), (PDB, "llm"), (SM, "llm"), (CR, "llm")]
    versions = {key: len(k8s.objects[key[0], NS, key[1]].history) for key in children}
    objects = len([o for o in k8s.objects.values() if not o.deleted])
    requests_before = len(list(k8s))
    async with running_operator(k8s):
        # the resume handler re-applies everything: wait until it has, and a few status refreshes
        await eventually(
            lambda: (
                sum(
                    1
                    for r in list(k8s)[requests_before:]
                    if r.method == "PATCH" and r.resource == DEP_RESOURCE
                )
                >= 1
            ),
            what="resume re-applied the Deployment",
        )
        await eventually(
            lambda: (
                sum(
                    1
                    for r in list(k8s)[requests_before:]
                    if r.method == "GET" and r.resource is not None and r.resource.plural == "pods"
                )
                >= 3
            ),
            what="status refreshes",
        )
    assert {key: len(k8s.objects[key[0], NS, key[1]].history) for key in children} == versions
    assert len([o for o in k8s.objects.values() if not o.deleted]) == objects


async def test_missing_servicemonitor_crd_is_reported(kmock, tmp_path, monkeypatch):
    prepare_cluster(kmock, tmp_path, monkeypatch, service_monitors=False)
    async with running_operator(kmock):
        await create(kmock, isvc())
        cond = await eventually(lambda: condition(kmock, "llm", "ServiceMonitor"))
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotFound")
        assert live(kmock, DEP, "llm")
        await eventually(lambda: any(e["reason"] == "ServiceMonitorSkipped" for e in events(kmock)))


async def test_a_refused_child_degrades_and_the_others_still_apply(k8s):
    # The API refuses the PVC (as it refuses most changes to a bound claim); kmock answers with the error.
    k8s["patch", kmock.resource("", "v1", "persistentvolumeclaims")] << kmock.KubernetesError(
        422, "Invalid", "spec: Forbidden: spec is immutable after creation"
    )
    async with running_operator(k8s):
        await create(k8s, isvc())
        degraded = await eventually(
            lambda: (
                condition(k8s, "llm", "Degraded")["status"] == "True" and condition(k8s, "llm", "Degraded")
            ),
            what="Degraded",
        )
        assert degraded["reason"] == "ApplyFailed"
        assert (
            "PersistentVolumeClaim llm-weights" in degraded["message"] and "immutable" in degraded["message"]
        )
        assert live(k8s, DEP, "llm") and live(k8s, SVC, "llm")
        # status refreshes keep reporting it until a reconcile succeeds
        await asyncio.sleep(0.5)
        assert condition(k8s, "llm", "Degraded")["reason"] == "ApplyFailed"


async def test_liveness_endpoint(k8s, unused_tcp_port):
    url = f"http://127.0.0.1:{unused_tcp_port}/healthz"
    async with (
        running_operator(k8s, liveness=url),
        aiohttp.ClientSession() as session,
        session.get(url) as resp,
    ):
        assert resp.status == 200


async def test_peering_lets_only_the_highest_priority_replica_act(k8s):
    def applies() -> int:
        return sum(
            1
            for r in list(k8s)
            if r.method == "PATCH" and r.resource == DEP_RESOURCE and r.params.get("fieldManager")
        )

    async with (
        running_operator(k8s, identity="low", priority=10),
        running_operator(k8s, identity="high", priority=20),
    ):
        peers = lambda: k8s.objects["kopf.dev/v1/clusterkopfpeerings", None, "pagoda"].get("status") or {}  # noqa: E731
        await eventually(lambda: {"low", "high"} <= set(peers()), what="both replicas in the peering object")
        await asyncio.sleep(0.5)  # the low one has read the peering object and paused
        await create(k8s, isvc())
        await eventually(lambda: live(k8s, DEP, "llm"))
        await settled(k8s)
        assert applies() == 1  # one reconcile: a second acting replica would have applied again
    # (when "high" stops first, "low" resumes and re-applies: correct, and not counted above)


async def test_pagoda_operator_process_serves_health_metrics_and_reconciles(k8s, unused_tcp_port_factory):
    """The real `pagoda operator` command in its own process, logging in through the kubeconfig."""
    import os
    import signal
    import sys

    health, metrics_port = unused_tcp_port_factory(), unused_tcp_port_factory()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pagoda.cli",
        "operator",
        "--all-namespaces",
        "--standalone",
        f"--health-port={health}",
        f"--metrics-port={metrics_port}",
        "--status-interval=0.5",
        env={**os.environ, "PAGODA_SERVER_IMAGE": "registry.test/from-env:1"},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as session:

            async def ok(url: str) -> str | None:
                try:
                    async with session.get(url) as resp:
                        return await resp.text() if resp.status == 200 else None
                except aiohttp.ClientError:
                    return None

            async def wait_ok(url: str) -> str:
                for _ in range(200):
                    if (text := await ok(url)) is not None:
                        return text
                    await asyncio.sleep(0.1)
                raise AssertionError(f"{url} never answered 200")

            await wait_ok(f"http://127.0.0.1:{health}/healthz")
            await create(k8s, isvc())
            dep = await eventually(
                lambda: live(k8s, DEP, "llm"), timeout=30, what="Deployment from the process"
            )
            assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.test/from-env:1"
            await eventually(lambda: live(k8s, CR, "llm")["status"]["observedGeneration"] == 1)
            text = await wait_ok(f"http://127.0.0.1:{metrics_port}/metrics")
            assert 'pagoda_operator_reconciles_total{result="success"} 1.0' in text
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()[-2000:]
