"""The Gateway API inference extension and KEDA: the InferencePool the operator renders (schema-valid
against one written from the published CRD, selecting exactly the serving pods), the pod label and
metric names the endpoint picker reads, the pool's life in the emulator (created, owned, removed,
skipped with a condition without its CRD), and the KEDA ScaledObject example."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from crd_validation import admission_errors, foreign_admission_errors
from operator_harness import (
    CR,
    CR_URL,
    DEP,
    NS,
    POOL,
    condition,
    create,
    events,
    eventually,
    isvc,
    live,
    patch,
    prepare_cluster,
    running_operator,
)
from pagoda.operator import crd, render, routing
from support.kube_emulator import KubeEmulator, labels_match

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).parent / "schemas"
POOL_SCHEMA = yaml.safe_load((SCHEMAS / "inferencepool-v1.yaml").read_text())
KEDA_SCHEMA = yaml.safe_load((SCHEMAS / "keda-scaledobject-v1alpha1.yaml").read_text())
KEDA_EXAMPLE = ROOT / "examples" / "keda" / "scaledobject.yaml"
OWNER = render.Owner(name="llm", namespace="ml", uid="uid-1")


def pool_spec(**pool) -> dict:
    return {"model": {"uri": "hf://org/m"}, "routing": {"inferencePool": {"enabled": True, **pool}}}


def children(spec: dict, pools: bool = True) -> render.Desired:
    return render.render(OWNER, crd.with_defaults(spec), default_image="img", service_monitors_served=False,
                         inference_pools_served=pools)  # fmt: skip


def by_kind(desired: render.Desired) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in desired.objects}


def env(deployment: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_pool_selects_exactly_the_serving_pods_and_points_at_the_picker():
    kinds = by_kind(children(pool_spec()))
    pool, deployment = kinds["InferencePool"], kinds["Deployment"]
    assert foreign_admission_errors(pool, POOL_SCHEMA) == []
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    assert labels_match(selector, deployment["spec"]["template"]["metadata"]["labels"])
    other = by_kind(render.render(render.Owner("other", "ml", "u2"), crd.with_defaults(pool_spec()), default_image="img",
                                  service_monitors_served=False, inference_pools_served=True))["Deployment"]
    assert not labels_match(selector, other["spec"]["template"]["metadata"]["labels"])  # another service's pods
    assert pool["spec"]["targetPorts"] == [{"number": render.SERVER_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "llm-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[routing.ENGINE_TYPE_LABEL] == "vllm"
    assert env(deployment)["PAGODA_VLLM_COMPATIBLE_METRICS"] == "true"
    custom = by_kind(children(pool_spec(endpointPicker={"name": "picker", "port": 9100, "failureMode": "FailOpen"})))
    assert custom["InferencePool"]["spec"]["endpointPickerRef"]["name"] == "picker"
    assert custom["InferencePool"]["spec"]["endpointPickerRef"]["port"] == {"number": 9100}


def test_without_the_crd_or_the_ask_there_is_no_pool():
    assert "InferencePool" not in by_kind(children(pool_spec(), pools=False))
    plain = children({"model": {"uri": "hf://org/m"}})
    assert "InferencePool" not in by_kind(plain) and (render.INFERENCE_POOL, "llm") in plain.absent
    deployment = by_kind(plain)["Deployment"]
    assert "PAGODA_VLLM_COMPATIBLE_METRICS" not in env(deployment)
    assert routing.ENGINE_TYPE_LABEL not in deployment["spec"]["template"]["metadata"]["labels"]
    metrics_only = by_kind(children({"model": {"uri": "hf://org/m"}, "monitoring": {"vllmCompatibleMetrics": True}}))
    assert env(metrics_only["Deployment"])["PAGODA_VLLM_COMPATIBLE_METRICS"] == "true"
    assert "InferencePool" not in metrics_only


def test_the_pool_schema_check_catches_a_bad_pool():
    pool = by_kind(children(pool_spec()))["InferencePool"]
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPorts"] = [{"number": 0}]
    assert any("targetPorts" in e for e in foreign_admission_errors(bad, POOL_SCHEMA))
    no_port = copy.deepcopy(pool)
    del no_port["spec"]["endpointPickerRef"]["port"]
    assert foreign_admission_errors(no_port, POOL_SCHEMA) == [
        "spec.endpointPickerRef: port is required when kind is 'Service' or unspecified (defaults to 'Service')"]
    unknown = copy.deepcopy(pool)
    unknown["spec"]["extensionRef"] = {"name": "x"}  # the pre-v1 field name
    assert foreign_admission_errors(unknown, POOL_SCHEMA)


def test_routing_fields_are_validated_by_the_crd():
    ok = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "x"}, "spec": pool_spec()}
    assert admission_errors(ok) == []
    bad = copy.deepcopy(ok)
    bad["spec"]["routing"]["inferencePool"]["endpointPicker"] = {"port": 70000, "failureMode": "Maybe"}
    assert len(admission_errors(bad)) == 2


def test_keda_example_is_a_valid_scaled_object_on_the_scale_subresource():
    example = yaml.safe_load(KEDA_EXAMPLE.read_text())
    assert foreign_admission_errors(example, KEDA_SCHEMA) == []
    target = example["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == (crd.API_VERSION, crd.KIND)
    assert "scale" in crd.crd()["spec"]["versions"][0]["subresources"]  # what KEDA's HPA scales
    documented = set(re.findall(r"^\| `(pagoda_[a-z0-9_]+)` \|", (ROOT / "docs" / "metrics.md").read_text(),
                                flags=re.MULTILINE))  # fmt: skip
    for trigger in example["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        assert {"serverAddress", "query", "threshold"} <= set(trigger["metadata"])  # KEDA's prometheus scaler
        names = set(re.findall(r"(pagoda_[a-z0-9_]+)\{", trigger["metadata"]["query"]))
        assert names and names <= documented, names
    broken = copy.deepcopy(example)
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA's metadata values are strings
    assert foreign_admission_errors(broken, KEDA_SCHEMA)




@pytest.mark.kmock(cls=KubeEmulator)
@pytest.mark.timeout(120)
async def test_pool_is_created_owned_and_removed_in_the_emulator(kmock, tmp_path, monkeypatch):
    prepare_cluster(kmock, tmp_path, monkeypatch)
    async with running_operator(kmock):
        owner = await create(kmock, isvc(routing={"inferencePool": {"enabled": True}}))
        pool = await eventually(lambda: live(kmock, POOL, "llm"), what="the InferencePool")
        assert pool["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        assert foreign_admission_errors(pool, POOL_SCHEMA) == []
        deployment = live(kmock, DEP, "llm")
        assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        await eventually(lambda: condition(kmock, "llm", "InferencePool")["reason"] == "Created")
        await patch(kmock, f"{CR_URL}/llm", {"spec": {"routing": {"inferencePool": {"enabled": False}}}})
        await eventually(lambda: kmock.objects[POOL, NS, "llm"].deleted, what="the pool deleted")
        await eventually(lambda: all(c["type"] != "InferencePool" for c in live(kmock, CR, "llm")["status"]["conditions"]))
        await patch(kmock, f"{CR_URL}/llm", {"spec": {"routing": {"inferencePool": {"enabled": True}}}})
        await eventually(lambda: live(kmock, POOL, "llm"), what="the pool again")
        await kmock.delete(f"{CR_URL}/llm")
        await eventually(lambda: kmock.objects[POOL, NS, "llm"].deleted, what="the pool garbage-collected")


@pytest.mark.kmock(cls=KubeEmulator)
@pytest.mark.timeout(120)
async def test_without_the_crd_a_condition_and_an_event_say_why(kmock, tmp_path, monkeypatch):
    prepare_cluster(kmock, tmp_path, monkeypatch, inference_pools=False)
    async with running_operator(kmock):
        await create(kmock, isvc(routing={"inferencePool": {"enabled": True}}))
        cond = await eventually(lambda: condition(kmock, "llm", "InferencePool"))
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotFound")
        await eventually(lambda: any(e["reason"] == "InferencePoolSkipped" for e in events(kmock)), what="event")
        assert "PAGODA_VLLM_COMPATIBLE_METRICS" in env(live(kmock, DEP, "llm"))  # the names are on regardless
