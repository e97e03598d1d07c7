"""Tensor parallelism in the operator: GPUs → --tensor-parallel-size, /dev/shm, and multi-node groups
as a LeaderWorkerSet (golden object, the published CRD's schema, every pod template a valid Pod), the
condition when its CRD is absent, and the real operator creating and scaling it on the emulator.

Regenerate the golden with `PAGODA_REGEN_GOLDEN=1 pytest tests/operator/test_operator_leaderworkerset.py`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crd_validation import admission_errors, foreign_admission_errors
from operator_harness import (
    CR_URL,
    DEP,
    LWS,
    NS,
    condition,
    create,
    eventually,
    isvc,
    live,
    patch,
    prepare_cluster,
    running_operator,
)
from pagoda.operator import crd, render, status
from pagoda.operator import leaderworkerset as lws
from support.kube_emulator import KubeEmulator, declare_builtin_resources

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "multi-node-70b.yaml"
SCHEMA = yaml.safe_load((Path(__file__).parent / "schemas" / "leaderworkerset-v1.yaml").read_text())
K8S_VERSION = kubernetes_validate.latest_version()
OWNER = render.Owner(name="llm", namespace="ml", uid="0a1b2c3d-0000-4000-8000-000000000001")
IMAGE = "ghcr.io/pagoda-dev/pagoda-server:0.1.0"


def example() -> dict:
    return yaml.safe_load((ROOT / "examples" / "multi-node-70b.yaml").read_text())["spec"]


def rendered(spec: dict, served: bool = True) -> render.Desired:
    return render.render(OWNER, crd.with_defaults(spec), default_image=IMAGE, service_monitors_served=True,
                         leader_worker_sets_served=served)  # fmt: skip


def by_kind(desired: render.Desired) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in desired.objects}


def env_of(template: dict) -> dict[str, dict]:
    return {e["name"]: e for e in template["spec"]["containers"][0]["env"]}


def test_golden():
    text = yaml.safe_dump_all(rendered(example()).objects, sort_keys=True, width=110)
    if os.environ.get("PAGODA_REGEN_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        f"render changed: review, then regenerate {GOLDEN} (PAGODA_REGEN_GOLDEN=1)"
    )


def test_the_group_is_a_valid_leaderworkerset_of_valid_pods():
    desired = rendered(example())
    group = by_kind(desired)["LeaderWorkerSet"]
    assert foreign_admission_errors(group, SCHEMA) == []
    template = group["spec"]["leaderWorkerTemplate"]
    for name in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml",
               **template[name]["metadata"]}, "spec": template[name]["spec"]}  # fmt: skip
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    for obj in desired.objects:
        if obj["kind"] not in ("LeaderWorkerSet", "ServiceMonitor"):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert (render.DEPLOYMENT, "llm") in desired.absent and "Deployment" not in by_kind(desired)


def test_the_schema_check_catches_a_bad_group():
    group = by_kind(rendered(example()))["LeaderWorkerSet"]
    bad = copy.deepcopy(group)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    assert any("restartPolicy" in e for e in foreign_admission_errors(bad, SCHEMA))
    del bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert any("workerTemplate" in e for e in foreign_admission_errors(bad, SCHEMA))


def test_leader_serves_and_workers_run_their_ranks():
    group = by_kind(rendered(example()))["LeaderWorkerSet"]["spec"]
    assert (group["replicas"], group["leaderWorkerTemplate"]["size"]) == (1, 2)
    assert group["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = (group["leaderWorkerTemplate"][k] for k in ("leaderTemplate", "workerTemplate"))
    assert leader["spec"]["containers"][0]["command"] == ["pagoda", "serve"]
    assert worker["spec"]["containers"][0]["command"] == ["pagoda", "worker"]
    for template in (leader, worker):
        variables = env_of(template)
        assert variables["PAGODA_TENSOR_PARALLEL_SIZE"]["value"] == "16"
        assert variables["PAGODA_NNODES"]["value"] == "2"
        assert variables["MASTER_PORT"]["value"] == str(lws.RENDEZVOUS_PORT)
        container = template["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert {v["name"] for v in template["spec"]["volumes"]} >= {"models", "dshm"}
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        shm = next(v for v in template["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["sizeLimit"] == "16Gi"
    rank = env_of(worker)["PAGODA_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == f"metadata.labels['{lws.WORKER_INDEX_LABEL}']"
    assert "PAGODA_NODE_RANK" not in env_of(leader)
    # One download per group, by the leader; the worker waits for its completion marker.
    assert [c["name"] for c in leader["spec"]["initContainers"]] == ["model-download"]
    (wait,) = worker["spec"]["initContainers"]
    assert wait["name"] == lws.WAIT_CONTAINER and "HF_TOKEN" not in str(wait)
    assert ".pagoda-download-complete" in wait["command"][-1]
    # The Service, PDB, status and autoscaler select leaders only: a group is one replica.
    selector = render.selector_labels(OWNER)
    assert selector.items() <= leader["metadata"]["labels"].items()
    assert not selector.items() <= worker["metadata"]["labels"].items()


def test_one_node_sets_the_tensor_parallel_size_from_the_gpus():
    spec = {"model": {"uri": "hf://o/m"}, "resources": {"gpus": 4}}
    dep = by_kind(rendered(spec))["Deployment"]
    variables = env_of(dep["spec"]["template"])
    assert variables["PAGODA_TENSOR_PARALLEL_SIZE"]["value"] == "4" and "PAGODA_NNODES" not in variables
    shm = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["sizeLimit"] == "8Gi"
    spec["engine"] = {"tensorParallelSize": 2}
    spec["resources"]["shmSize"] = "3Gi"
    dep = by_kind(rendered(spec))["Deployment"]
    assert env_of(dep["spec"]["template"])["PAGODA_TENSOR_PARALLEL_SIZE"]["value"] == "2"
    assert "3Gi" in str(dep["spec"]["template"]["spec"]["volumes"])
    one = by_kind(rendered({"model": {"uri": "hf://o/m"}}))["Deployment"]
    assert "PAGODA_TENSOR_PARALLEL_SIZE" not in env_of(one["spec"]["template"])
    assert (render.LEADER_WORKER_SET, "llm") in rendered({"model": {"uri": "hf://o/m"}}).absent


def test_without_the_crd_nothing_runs_and_a_condition_says_so():
    desired = rendered(example(), served=False)
    assert not {"Deployment", "LeaderWorkerSet"} & set(by_kind(desired))
    cond = status.optional_child_condition("LeaderWorkerSet", "CRDNotFound")
    assert cond["status"] == "False" and "install LeaderWorkerSet" in cond["message"]
    assert status.group_description(crd.with_defaults(example())) == "2 nodes × 8 GPUs, TP 16"


def test_the_crd_refuses_ranks_that_do_not_split_over_the_nodes():
    body = {"apiVersion": "serving.pagoda.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "x"}, "spec": {**example(), "engine": {"tensorParallelSize": 3}}}  # fmt: skip
    assert any("multiple of parallelism.nodes" in e for e in admission_errors(body))
    body["spec"]["engine"]["tensorParallelSize"] = 16
    assert admission_errors(body) == []


# --- the emulator and the real operator -------------------------------------------------------------------

LWS_URL = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets"


@pytest.mark.kmock(cls=KubeEmulator)
async def test_the_emulator_creates_and_scales_a_leaderworkerset(kmock):
    declare_builtin_resources(kmock, leader_worker_sets=True)
    group = {**by_kind(rendered(example()))["LeaderWorkerSet"]}
    group["metadata"] = {"name": "g", "namespace": NS}
    assert (await kmock.post(LWS_URL, json=group)).status == 200
    await kmock.patch(f"{LWS_URL}/g/status", json={"status": {"replicas": 1, "hpaPodSelector": "a=b"}},
                      headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
    scale = await (
        await kmock.patch(
            f"{LWS_URL}/g/scale",
            json={"spec": {"replicas": 3}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
    ).json()
    assert scale["spec"]["replicas"] == 3 and scale["status"]["selector"] == "a=b"
    assert kmock.objects[LWS, NS, "g"]["spec"]["replicas"] == 3


@pytest.mark.kmock(cls=KubeEmulator)
@pytest.mark.timeout(120)
async def test_the_operator_runs_a_group_and_scales_it_by_the_inferenceservice(kmock, tmp_path, monkeypatch):
    prepare_cluster(kmock, tmp_path, monkeypatch)
    async with running_operator(kmock):
        rwx = {"accessModes": ["ReadWriteMany"]}
        await create(kmock, isvc(parallelism={"nodes": 2}, resources={"gpus": 2}, storage=rwx))
        group = await eventually(lambda: live(kmock, LWS, "llm"))
        assert group["spec"]["leaderWorkerTemplate"]["size"] == 2
        await eventually(lambda: condition(kmock, "llm", "LeaderWorkerSet")["reason"] == "Created")
        await patch(kmock, f"{CR_URL}/llm/scale", {"spec": {"replicas": 3}})
        await eventually(lambda: live(kmock, LWS, "llm")["spec"]["replicas"] == 3)
        await patch(kmock, f"{LWS_URL}/llm/status", {"status": {"replicas": 3, "readyReplicas": 3,
                                                              "updatedReplicas": 3}})  # fmt: skip
        await eventually(lambda: live(kmock, "serving.pagoda.dev/v1alpha1/inferenceservices", "llm")["status"]
                         .get("readyReplicas") == 3, what="ready groups in status")  # fmt: skip
        assert live(kmock, "serving.pagoda.dev/v1alpha1/inferenceservices", "llm")["status"]["group"] == (
            "2 nodes × 2 GPUs, TP 4"
        )
        await patch(kmock, f"{CR_URL}/llm", {"spec": {"parallelism": {"nodes": 1}}})
        await eventually(lambda: live(kmock, DEP, "llm") and kmock.objects[LWS, NS, "llm"].deleted)


@pytest.mark.kmock(cls=KubeEmulator)
@pytest.mark.timeout(120)
async def test_a_group_without_the_crd_gets_a_condition(kmock, tmp_path, monkeypatch):
    prepare_cluster(kmock, tmp_path, monkeypatch, leader_worker_sets=False)
    async with running_operator(kmock):
        await create(kmock, isvc(parallelism={"nodes": 2}, storage={"accessModes": ["ReadWriteMany"]}))
        cond = await eventually(lambda: condition(kmock, "llm", "LeaderWorkerSet"))
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotFound")
        assert ("apps/v1/deployments", NS, "llm") not in kmock.objects
