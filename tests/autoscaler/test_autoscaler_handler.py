"""The autoscaler's kopf daemon, run by the real kopf against the kube emulator, with looptime fast-forwarding.

What stands in for what (nothing here can run a cluster):
- the API server: kmock's emulator with our extensions (tests/support/kube_emulator.py), over HTTP;
- serving pods: Pod objects we create in the emulator (no controller makes them), each pointing by the
  metrics-port annotation at a small aiohttp server on loopback that serves fixed metrics text;
- the operator's reconcile (status.selector, Deployment): not run; the test sets status.selector.
Loop time is fake (looptime), so the 15 s interval and 60 s windows take well under a second each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import kopf
import pytest
from pagoda.operator import crd
from pagoda.operator.autoscaling import handlers
from pagoda.operator.autoscaling.collect import METRICS_PORT_ANNOTATION
from support.autoscaler_pods import FakePod, FakePodFarm, metrics_text
from support.kube_emulator import KubeEmulator, declare_builtin_resources

NS, NAME = "ns1", "llm"
CR = f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"
CR_URL = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{NS}/{crd.PLURAL}"
PODS_URL = f"/api/v1/namespaces/{NS}/pods"
MERGE = {"Content-Type": "application/merge-patch+json"}
AUTOSCALING = {
    "enabled": True,
    "minReplicas": 1,
    "maxReplicas": 4,
    "intervalSeconds": 15,
    "scaleDownStabilizationSeconds": 60,
}

pytestmark = [pytest.mark.kmock(cls=KubeEmulator), pytest.mark.looptime]


@pytest.fixture
def k8s(kmock: KubeEmulator) -> KubeEmulator:
    declare_builtin_resources(kmock)
    kmock.resources[CR] = kmock.ResourceInfo(
        kind="InferenceService",
        singular="inferenceservice",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources={"status", "scale"},
    )
    return kmock


def registry_for(url: str) -> kopf.OperatorRegistry:
    """Only the autoscaler's handler (whatever else the test process has imported), logged in to the emulator."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def settings(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = True
        settings.posting.level = logging.WARNING  # as `pagoda operator`: the scale Events must still go out

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True)

    kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry, cancellation_timeout=10.0)(
        handlers.autoscaler
    )
    return registry


@contextlib.asynccontextmanager
async def running_operator(k8s: KubeEmulator) -> AsyncIterator[None]:
    """The real kopf operator with the autoscaler's handler, for the duration of the block.

    Started in the test's own task, not in a fixture: on exit kopf cancels the tasks started while it
    ran, which would include a fixture's teardown task.
    """
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry_for(str(k8s.url).rstrip("/")),
            clusterwide=True,
            standalone=True,
            stop_flag=stop,
            ready_flag=ready,
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), 30)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def eventually(predicate: Callable[[], bool], timeout: float = 120.0) -> None:
    """Poll in loop time (fast-forwarded): `timeout` is fake seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not _safe(predicate):
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout} loop-seconds")
        await asyncio.sleep(0.5)


def _safe(predicate: Callable[[], bool]) -> bool:
    try:
        return bool(predicate())
    except (KeyError, TypeError):
        return False


async def create_isvc(k8s: KubeEmulator, replicas: int, autoscaling: dict[str, Any]) -> None:
    body = {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"model": {"uri": "hf://org/tiny"}, "replicas": replicas, "autoscaling": autoscaling},
    }
    resp = await k8s.post(CR_URL, json=body)
    assert resp.status in (200, 201), await resp.text()
    # The operator's reconcile would publish the selector; here the test does (see module docstring).
    resp = await k8s.patch(f"{CR_URL}/{NAME}/status", json={"status": {"selector": "app=llm"}}, headers=MERGE)
    assert resp.status == 200, await resp.text()


async def add_pod(k8s: KubeEmulator, name: str, fake: FakePod, ready: bool = True) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app": "llm"},
            "annotations": {METRICS_PORT_ANNOTATION: str(fake.port)},
        },
        "spec": {"containers": [{"name": "server", "image": "pagoda-server"}]},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }
    resp = await k8s.post(PODS_URL, json=body)
    assert resp.status in (200, 201), await resp.text()


def isvc(k8s: KubeEmulator) -> Any:
    return k8s.objects[CR, NS, NAME]


def replicas(k8s: KubeEmulator) -> int:
    return isvc(k8s)["spec"]["replicas"]


def events(k8s: KubeEmulator) -> list[dict[str, Any]]:
    return [dict(o) for (r, _, _), o in list(k8s.objects.items()) if r.plural == "events" and not o.deleted]


async def test_scales_up_on_kv_then_down_after_the_window(k8s: KubeEmulator, fake_pods: FakePodFarm) -> None:
    loop = asyncio.get_running_loop()
    pod0 = await fake_pods.start(metrics_text(kv=0.98, waiting=1))  # KV near full: ceil(1 × 0.98/0.7) = 2
    await create_isvc(k8s, replicas=1, autoscaling=AUTOSCALING)
    await add_pod(k8s, "llm-0", pod0)
    async with running_operator(k8s):
        await eventually(lambda: replicas(k8s) == 2)
        status = isvc(k8s)["status"]
        assert status["kvCache"]["usage"] == 0.98
        assert status["kvCache"]["capacityTokens"] == 64 * 16 and status["kvCache"]["blockSize"] == 16
        assert status["autoscaling"]["desiredReplicas"] == 2
        assert status["autoscaling"]["proposals"]["kvCacheUsage"]["replicas"] == 2
        assert status["autoscaling"]["metrics"]["llm-0"]["kvCacheUsage"] == 0.98
        assert "kvCacheUsage proposes 2" in status["autoscaling"]["reason"]
        assert "lastScaleTime" in status["autoscaling"]
        await eventually(lambda: any(e.get("reason") == "ScaledUp" for e in events(k8s)))
        assert "1 → 2" in next(e for e in events(k8s) if e.get("reason") == "ScaledUp")["message"]

        # The second replica arrives; the load spreads, then stops.
        pod1 = await fake_pods.start(metrics_text(kv=0.5, waiting=0))
        await add_pod(k8s, "llm-1", pod1)
        pod0.text = metrics_text(kv=0.5, waiting=0)
        await eventually(
            lambda: isvc(k8s)["status"]["autoscaling"]["metrics"]["llm-1"]["kvCacheUsage"] == 0.5
        )
        assert replicas(k8s) == 2  # 0.5/0.7: still worth 2 (ceil(2 × 0.71) = 2)
        pod0.text = pod1.text = metrics_text(kv=0.0, waiting=0)
        idle_since = loop.time()
        await eventually(
            lambda: isvc(k8s)["status"]["autoscaling"]["proposals"]["kvCacheUsage"]["replicas"] == 0
        )
        assert replicas(k8s) == 2  # proposal ceil(2 × 0 / 0.7) = 0, but the window holds the earlier 2
        assert "scale-down stabilized" in isvc(k8s)["status"]["autoscaling"]["reason"]

        await eventually(lambda: replicas(k8s) == 1, timeout=180)
        waited = loop.time() - idle_since
        assert 45 <= waited <= 60 + 2 * 15, waited  # the last "2" leaves the 60 s window, plus ≤ one interval
        await eventually(lambda: any(e.get("reason") == "ScaledDown" for e in events(k8s)))


async def test_queue_spike_and_missing_pods(k8s: KubeEmulator, fake_pods: FakePodFarm) -> None:
    """Scale on queue depth with low KV; a not-ready pod and a dead pod count as missing (0 on scale-up)."""
    busy = await fake_pods.start(metrics_text(kv=0.2, waiting=24))
    dead = await fake_pods.start(metrics_text(kv=0.2, waiting=24))
    dead.status = 503
    await create_isvc(k8s, replicas=3, autoscaling=AUTOSCALING)
    await add_pod(k8s, "llm-0", busy)
    await add_pod(k8s, "llm-1", dead)
    await add_pod(k8s, "llm-2", busy, ready=False)
    async with running_operator(k8s):
        # queue: 24 waiting on the one pod that answered, 0 for the 2 missing → 8 per pod, 2× the target 4.
        await eventually(lambda: replicas(k8s) == 4)  # ceil(3 × 2) = 6, clamped to maxReplicas 4
    auto = isvc(k8s)["status"]["autoscaling"]
    assert auto["proposals"]["queueDepth"]["podsMissing"] == 2
    assert auto["proposals"]["queueDepth"]["replicas"] == 6
    assert auto["metrics"]["llm-1"]["error"] == "HTTP 503"
    assert auto["metrics"]["llm-2"] == {"ready": False}
    assert "queueDepth proposes 6" in auto["reason"] and "maxReplicas 4" in auto["reason"]


async def test_disabled_never_touches_replicas_but_reports_kv(
    k8s: KubeEmulator, fake_pods: FakePodFarm
) -> None:
    """Switched off (here: after a decision was recorded), it only reports: spec.replicas is the user's."""
    full = await fake_pods.start(metrics_text(kv=1.0, waiting=40))
    await create_isvc(k8s, replicas=1, autoscaling={**AUTOSCALING, "enabled": False})
    await k8s.patch(
        f"{CR_URL}/{NAME}/status", json={"status": {"autoscaling": {"desiredReplicas": 3}}}, headers=MERGE
    )
    await add_pod(k8s, "llm-0", full)
    async with running_operator(k8s):
        await eventually(lambda: isvc(k8s)["status"]["kvCache"]["usage"] == 1.0)
        await asyncio.sleep(60)  # four more rounds
    assert replicas(k8s) == 1
    assert "autoscaling" not in isvc(k8s)["status"]  # the stale decision is gone
    assert not any(r.subresource == "scale" and r.action == kmock.action.UPDATE for r in list(k8s))


async def test_no_autoscaler_switch_leaves_replicas_to_keda(k8s: KubeEmulator, fake_pods: FakePodFarm,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`pagoda operator --no-autoscaler`: even an object asking for the built-in autoscaler is not scaled
    (KEDA or an HPA owns spec.replicas), one Warning says so, and kvCache is still reported."""
    monkeypatch.setattr(handlers.SWITCH, "enabled", False)
    full = await fake_pods.start(metrics_text(kv=1.0, waiting=40))
    await create_isvc(k8s, replicas=1, autoscaling=AUTOSCALING)
    await add_pod(k8s, "llm-0", full)
    async with running_operator(k8s):
        await eventually(lambda: isvc(k8s)["status"]["kvCache"]["usage"] == 1.0)
        await asyncio.sleep(60)  # four more rounds, each of which would scale up
    assert replicas(k8s) == 1
    assert not any(r.subresource == "scale" and r.action == kmock.action.UPDATE for r in list(k8s))
    assert [e["reason"] for e in events(k8s)].count("AutoscalerOff") == 1


async def test_restarted_operator_remembers_the_window(k8s: KubeEmulator, fake_pods: FakePodFarm) -> None:
    """Recommendations mirrored in status survive a restart, and the time the operator was down counts as
    the current count: no scale-down before a full window of the new operator's own readings."""
    loop = asyncio.get_running_loop()
    pods = [await fake_pods.start(metrics_text(kv=0.7, waiting=4)) for _ in range(3)]
    await create_isvc(k8s, replicas=3, autoscaling={**AUTOSCALING, "scaleDownStabilizationSeconds": 120})
    for i, pod in enumerate(pods):
        await add_pod(k8s, f"llm-{i}", pod)
    async with running_operator(k8s):
        await eventually(lambda: isvc(k8s)["status"]["autoscaling"]["history"])
        await asyncio.sleep(30)  # two more rounds: the history's newest "3" is from just before the stop
    last_recorded = loop.time()

    for pod in pods:
        pod.text = metrics_text(kv=0.0, waiting=0)
    await asyncio.sleep(60)  # the operator is down for a minute
    async with running_operator(k8s):  # a new operator: its memory is empty, the status is not
        restarted = loop.time()
        await asyncio.sleep(30)
        assert replicas(k8s) == 3  # the "3" recorded before the restart still holds the window
        # The mirrored "3" left the 120 s window 60 s after the restart; the unseen minute still holds.
        await asyncio.sleep(120 - 60 - 30 + 15)
        assert replicas(k8s) == 3
        await eventually(lambda: replicas(k8s) == 1, timeout=240)
        # Down one window after the restart: the minute the operator was down held the current count.
        assert 120 - 15 <= loop.time() - restarted <= 120 + 2 * 15
    assert restarted - last_recorded >= 60
