"""Run the real kopf operator (pagoda.operator.handlers) against the Kube emulator over HTTP.

The operator logs in the way it does in a cluster without a service account: kopf's kubeconfig
login, here with a kubeconfig file that points at the emulator. Nothing in the operator is mocked;
what a cluster's controllers would do (the Deployment controller making pods, kubelet statuses)
the tests do by writing pods and Deployment status into the emulator themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
import kubernetes.config.kube_config
import yaml
from pagoda.operator import crd, handlers
from pagoda.operator.kube import PeeringIdentity
from support.kube_emulator import declare_builtin_resources, declare_crd

NS = "ml"
CR = f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"
CR_URL = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{NS}/{crd.PLURAL}"
DEP, SVC, PVC, PDB, SM = ("apps/v1/deployments", "v1/services", "v1/persistentvolumeclaims",
                          "policy/v1/poddisruptionbudgets", "monitoring.coreos.com/v1/servicemonitors")
POOL = "inference.networking.k8s.io/v1/inferencepools"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
PODS_URL = f"/api/v1/namespaces/{NS}/pods"
PEERING = "pagoda"
TEST_IMAGE = "registry.test/pagoda-server:test"
MERGE = {"Content-Type": "application/merge-patch+json"}


def prepare_cluster(k8s: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: Any, *,
                    service_monitors: bool = True, inference_pools: bool = True,
                    leader_worker_sets: bool = True) -> None:
    """Declare resources, the namespace and the peering object; point kopf's login at the emulator."""
    declare_builtin_resources(k8s, service_monitors=service_monitors, inference_pools=inference_pools,
                              leader_worker_sets=leader_worker_sets)
    declare_crd(k8s, crd.crd())
    k8s.objects["v1/namespaces", None, NS] = {"apiVersion": "v1", "kind": "Namespace",
                                              "metadata": {"name": NS, "uid": "ns-uid"}}
    k8s.objects["kopf.dev/v1/clusterkopfpeerings", None, PEERING] = {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
        "metadata": {"name": PEERING, "uid": "peering-uid", "resourceVersion": "1"}}
    k8s.objects["kopf.dev/v1/kopfpeerings", NS, PEERING] = {
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
        "metadata": {"name": PEERING, "namespace": NS, "uid": "ns-peering-uid", "resourceVersion": "1"}}
    kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                  "clusters": [{"name": "emulator", "cluster": {"server": str(k8s.url).rstrip("/")}}],
                  "users": [{"name": "operator", "user": {}}],
                  "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "operator"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(path))
    # the kubernetes client reads $KUBECONFIG once, at import: point its default at our file too
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.setattr(handlers.CONFIG, "status_interval", 0.2)
    monkeypatch.setattr(handlers.CONFIG, "default_image", TEST_IMAGE)


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll `check` until it returns a truthy value (KeyError/IndexError count as not yet)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (KeyError, IndexError, ValueError, TypeError):
            pass
        if loop.time() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(0.05)


async def settled(k8s: kmock.KubernetesEmulator, quiet: float = 0.3, timeout: float = 5.0) -> None:
    """Wait until no writes came for `quiet` seconds (the status refresh only reads when idle).

    Stopping kopf mid-handler makes it wait 5 s for the handler's retries; tests need not pay that.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        writes = sum(1 for r in list(k8s) if r.method != "GET")
        await asyncio.sleep(quiet)
        if sum(1 for r in list(k8s) if r.method != "GET") == writes:
            return


@contextlib.asynccontextmanager
async def running_operator(k8s: kmock.KubernetesEmulator, namespaces: list[str] | None = None,
                           liveness: str | None = None, identity: str = "operator-0",
                           priority: int = 0, peering: str | None = PEERING) -> AsyncIterator[None]:
    """The operator as `pagoda operator --all-namespaces --peering=pagoda` runs it (or with
    `--namespace=NS` for each of `namespaces`; `peering=None`: `--standalone`), in its own thread.

    Its own thread and event loop, as in a real process: at exit kopf waits for, then cancels, every
    task of its loop, which must not include the emulator's request handlers.
    """
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(clusterwide=not namespaces, namespaces=namespaces or (),
                                      peering_name=peering, standalone=peering is None,
                                      liveness_endpoint=liveness,
                                      identity=PeeringIdentity(identity), priority=priority,
                                      stop_flag=stop, ready_flag=ready))
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 15), "the operator did not start"
        await eventually(lambda: any(r.action == kmock.action.WATCH and r.resource == kmock.resource(CR)
                                     for r in list(k8s)), what="the operator watching InferenceServices")
        yield
        await settled(k8s)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive(), "the operator did not stop"
    assert not errors, "".join(traceback.format_exception(errors[0]))  # where in kopf it came from


def isvc(name: str = "llm", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, **spec}}


def live(k8s: kmock.KubernetesEmulator, resource: str, name: str) -> dict[str, Any]:
    """The stored object, or KeyError when absent or deleted (for `eventually`)."""
    obj = k8s.objects[resource, NS, name]
    if obj.deleted:
        raise KeyError(name)
    return obj.raw


def condition(k8s: kmock.KubernetesEmulator, name: str, kind: str) -> dict[str, Any]:
    conditions = live(k8s, CR, name)["status"]["conditions"]
    return next(c for c in conditions if c["type"] == kind)


def events(k8s: kmock.KubernetesEmulator) -> list[dict[str, Any]]:
    return [obj.raw for (res, _, _), obj in k8s.objects.items() if res.plural == "events" and not obj.deleted]


async def create(k8s: kmock.KubernetesEmulator, body: dict[str, Any]) -> dict[str, Any]:
    resp = await k8s.post(CR_URL, json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def patch(k8s: kmock.KubernetesEmulator, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await k8s.patch(url, json=body, headers=MERGE)
    assert resp.status == 200, await resp.text()
    return await resp.json()


def server_pod(owner: dict[str, Any], name: str, container_status: dict[str, Any],
               phase: str = "Running") -> dict[str, Any]:
    """A serving pod as the Deployment controller + kubelet would leave it (labels from the template)."""
    dep_template = owner["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": dep_template["metadata"]["labels"]},
            "spec": {"containers": [{"name": "server", "image": TEST_IMAGE}]},
            "status": {"phase": phase,
                       "containerStatuses": [{"name": "server", "restartCount": 0, **container_status}]}}


async def set_deployment_status(k8s: kmock.KubernetesEmulator, name: str, **counts: int) -> None:
    """What the Deployment controller reports once it has seen the current generation."""
    generation = live(k8s, DEP, name)["metadata"]["generation"]
    await patch(k8s, f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/status",
                {"status": {"observedGeneration": generation, **counts}})
