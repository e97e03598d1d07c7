"""The emulator behaviours the operator tests rely on (tests/support/kube_emulator.py), checked over HTTP."""

from __future__ import annotations

import pytest
from support.kube_emulator import KubeEmulator, declare_builtin_resources, labels_match

pytestmark = pytest.mark.kmock(cls=KubeEmulator)

DEPLOYMENTS = "/apis/apps/v1/namespaces/ns1/deployments"
APPLY = {"Content-Type": "application/apply-patch+yaml"}
MERGE = {"Content-Type": "application/merge-patch+json"}


def deployment(name: str = "d", replicas: int = 1, **labels: str) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "ns1", "labels": labels or {"app": name}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": []}},
        },
    }


@pytest.fixture
def k8s(kmock):
    declare_builtin_resources(kmock)
    return kmock


async def test_create_stamps_server_metadata(k8s):
    created = await (await k8s.post(DEPLOYMENTS, json=deployment())).json()
    meta = created["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1
    event = await (
        await k8s.post("/api/v1/namespaces/ns1/events", json={"metadata": {"generateName": "x."}})
    ).json()
    assert event["metadata"]["name"].startswith("x.") and len(event["metadata"]["name"]) > 2


async def test_apply_upserts_and_removes_dropped_fields(k8s):
    url = f"{DEPLOYMENTS}/d?fieldManager=me&force=true"
    first = deployment(team="a")
    resp = await k8s.patch(url, json=first, headers=APPLY)
    assert resp.status == 200, await resp.text()
    assert k8s.objects["apps/v1/deployments", "ns1", "d"]["metadata"]["labels"] == {"team": "a"}
    second = deployment(other="b")
    await k8s.patch(url, json=second, headers=APPLY)
    assert k8s.objects["apps/v1/deployments", "ns1", "d"]["metadata"]["labels"] == {"other": "b"}
    resp = await k8s.patch(f"{DEPLOYMENTS}/d", json=second, headers=APPLY)
    assert resp.status == 400  # no fieldManager


async def test_status_isolation_generation_and_scale(k8s):
    await k8s.post(DEPLOYMENTS, json=deployment())
    await k8s.patch(f"{DEPLOYMENTS}/d", json={"status": {"replicas": 9}}, headers=MERGE)
    assert "status" not in k8s.objects["apps/v1/deployments", "ns1", "d"]
    await k8s.patch(
        f"{DEPLOYMENTS}/d/status", json={"spec": {"replicas": 7}, "status": {"replicas": 2}}, headers=MERGE
    )
    obj = k8s.objects["apps/v1/deployments", "ns1", "d"]
    assert obj["spec"]["replicas"] == 1 and obj["status"]["replicas"] == 2
    assert obj["metadata"]["generation"] == 1
    scale = await (
        await k8s.patch(f"{DEPLOYMENTS}/d/scale", json={"spec": {"replicas": 4}}, headers=MERGE)
    ).json()
    assert (
        scale["kind"] == "Scale" and scale["spec"]["replicas"] == 4 and scale["status"]["selector"] == "app=d"
    )
    obj = k8s.objects["apps/v1/deployments", "ns1", "d"]
    assert obj["spec"]["replicas"] == 4 and obj["metadata"]["generation"] == 2


async def test_label_selector_and_garbage_collection(k8s):
    owner = await (await k8s.post(DEPLOYMENTS, json=deployment("owner"))).json()
    ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "owner", "uid": owner["metadata"]["uid"]}
    pod = {
        "metadata": {"name": "p", "namespace": "ns1", "labels": {"app": "owner"}, "ownerReferences": [ref]}
    }
    await k8s.post("/api/v1/namespaces/ns1/pods", json=pod)
    await k8s.post("/api/v1/namespaces/ns1/pods", json={"metadata": {"name": "q", "labels": {"app": "x"}}})
    listed = await (await k8s.get("/api/v1/namespaces/ns1/pods?labelSelector=app%3Downer")).json()
    assert [p["metadata"]["name"] for p in listed["items"]] == ["p"]
    await k8s.delete(f"{DEPLOYMENTS}/owner")
    assert k8s.objects["v1/pods", "ns1", "p"].deleted
    assert not k8s.objects["v1/pods", "ns1", "q"].deleted


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("a=1,b", True),
        ("a!=1", False),
        ("a in (1,2),!c", True),
        ("a notin (1)", False),
        ("c", False),
        ("a==1", True),
    ],
)
def test_label_selector_grammar(selector, expected):
    assert labels_match(selector, {"a": "1", "b": "2"}) is expected
