"""render(): golden objects for a minimal and a full spec, every object valid for Kubernetes
(kubernetes-validate --strict), and the properties the goldens alone would not make obvious.

Regenerate the goldens with `PAGODA_REGEN_GOLDEN=1 pytest tests/operator/test_operator_render.py`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crd_validation import foreign_admission_errors
from pagoda.operator import crd, render, weights

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
K8S_VERSION = kubernetes_validate.latest_version()
OWNER = render.Owner(name="llm", namespace="ml", uid="0a1b2c3d-0000-4000-8000-000000000001")
IMAGE = "ghcr.io/pagoda-dev/pagoda-server:0.1.0"
INFERENCE_POOL_SCHEMA = yaml.safe_load((Path(__file__).parent / "schemas" / "inferencepool-v1.yaml").read_text())


def example_spec(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())["spec"]


def rendered(spec: dict, monitors: bool = True, pools: bool = False) -> render.Desired:
    return render.render(OWNER, crd.with_defaults(spec), default_image=IMAGE, service_monitors_served=monitors,
                         inference_pools_served=pools)


def by_kind(desired: render.Desired) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in desired.objects}


def server(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def env(obj: dict) -> dict[str, dict]:
    return {e["name"]: e for e in server(obj)["env"]}


@pytest.mark.parametrize("name", ["minimal", "full", "inference-pool"])
def test_golden(name):
    desired = rendered(example_spec(name), pools=True)
    text = yaml.safe_dump_all(desired.objects, sort_keys=True, width=110)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("PAGODA_REGEN_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"render changed: review, then regenerate {path} (PAGODA_REGEN_GOLDEN=1)"


EXAMPLE_NAMES = sorted(p.stem for p in (ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_every_rendered_object_is_valid_kubernetes(name):
    for obj in rendered(example_spec(name), pools=True).objects:
        if obj["kind"] == "InferencePool":  # its own schema, written from the published CRD
            assert foreign_admission_errors(obj, INFERENCE_POOL_SCHEMA) == []
            carrier = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": obj["metadata"],
                       "spec": {"selector": obj["spec"]["selector"]}}
            kubernetes_validate.validate(carrier, K8S_VERSION, strict=True)
            continue
        if obj["kind"] == "ServiceMonitor":
            # No schema for Prometheus Operator CRDs here: validate its core-typed parts (ObjectMeta,
            # LabelSelector) by carrying them in a PodDisruptionBudget, which has both.
            carrier = {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": obj["metadata"],
                "spec": {"selector": obj["spec"]["selector"]},
            }
            kubernetes_validate.validate(carrier, K8S_VERSION, strict=True)
            assert obj["spec"]["endpoints"] == [
                {"port": "http", "path": "/metrics", "interval": obj["spec"]["endpoints"][0]["interval"]}
            ]
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_children_and_what_is_absent():
    kinds = by_kind(rendered(example_spec("minimal")))
    assert sorted(kinds) == ["Deployment", "PersistentVolumeClaim", "Service", "ServiceMonitor"]
    assert rendered(example_spec("minimal")).absent == [(render.PDB, "llm")]
    assert "PodDisruptionBudget" in by_kind(rendered(example_spec("full")))
    no_crd = rendered(example_spec("minimal"), monitors=False)
    assert "ServiceMonitor" not in by_kind(no_crd) and no_crd.absent == [(render.PDB, "llm")]
    disabled = rendered(example_spec("baked-image"))
    assert "ServiceMonitor" not in by_kind(disabled) and (render.SERVICE_MONITOR, "llm") in disabled.absent
    for obj in rendered(example_spec("full")).objects:
        assert obj["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_template_hash_ignores_replicas_and_autoscaling_but_not_engine():
    base = example_spec("full")
    dep = by_kind(rendered(base))["Deployment"]
    scaled = copy.deepcopy(base)
    scaled["replicas"] = 5
    scaled["autoscaling"]["targetKVCacheUsage"] = 0.5
    scaled["monitoring"]["interval"] = "30s"
    dep_scaled = by_kind(rendered(scaled))["Deployment"]
    assert dep_scaled["spec"]["template"] == dep["spec"]["template"]
    assert dep_scaled["spec"]["replicas"] == 5
    changed = copy.deepcopy(base)
    changed["engine"]["maxNumSeqs"] = 64
    annotation = render.TEMPLATE_HASH_ANNOTATION
    assert (
        by_kind(rendered(changed))["Deployment"]["spec"]["template"]["metadata"]["annotations"][annotation]
        != dep["spec"]["template"]["metadata"]["annotations"][annotation]
    )


def test_pod_security_and_writable_mounts():
    dep = by_kind(rendered(example_spec("full")))["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"] + pod["initContainers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    mounts = {m["mountPath"]: m for m in server(dep)["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm" and mounts["/models"]["readOnly"] is True


def test_server_container_contract():
    spec = example_spec("full")
    dep = by_kind(rendered(spec))["Deployment"]
    container, variables = server(dep), env(dep)
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= spec["startupTimeoutSeconds"]
    assert (
        dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == spec["drainTimeoutSeconds"] + 10
    )
    assert variables["PAGODA_BLOCK_SIZE"]["value"] == "16"
    assert variables["PAGODA_ENABLE_PREFIX_CACHING"]["value"] == "true"
    assert variables["PAGODA_SERVED_MODEL_NAME"]["value"] == "llama-3.1-8b"
    assert variables["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["args"][-2:] == ["--log-level", "info"]


def test_download_init_container_for_hf_only():
    full = by_kind(rendered(example_spec("full")))
    init = full["Deployment"]["spec"]["template"]["spec"]["initContainers"][0]
    init_env = {e["name"]: e for e in init["env"]}
    assert init_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert init_env["HF_REVISION"]["value"] == "0e9e39f249a16976918f6564b8830bc894c89659"
    assert init["command"] == ["python", "-m", "pagoda.server.model_download"]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"  # the failure's cause, in status
    assert full["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    pvc_model = by_kind(rendered(example_spec("pvc-model")))
    assert "PersistentVolumeClaim" not in pvc_model
    pod = pvc_model["Deployment"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "model-store"}} in pod["volumes"]
    assert env(pvc_model["Deployment"])["PAGODA_MODEL"]["value"] == "/models/qwen2.5-1.5b-instruct"
    baked = by_kind(rendered(example_spec("baked-image")))["Deployment"]
    assert env(baked)["PAGODA_MODEL"]["value"] == "/weights/model"
    assert "nvidia.com/gpu" not in server(baked)["resources"]["requests"]


def test_user_env_replaces_ours_in_place():
    spec = example_spec("minimal")
    spec["env"] = [{"name": "PAGODA_DTYPE", "value": "float16"}, {"name": "EXTRA", "value": "1"}]
    names = [e["name"] for e in server(by_kind(rendered(spec))["Deployment"])["env"]]
    assert names.count("PAGODA_DTYPE") == 1 and names[-1] == "EXTRA"
    assert env(by_kind(rendered(spec))["Deployment"])["PAGODA_DTYPE"]["value"] == "float16"


@pytest.mark.parametrize(
    ("uri", "served"),
    [
        ("hf://org/Model-7B@v2", "Model-7B"),
        ("pvc://claim/dir/qwen", "qwen"),
        ("file:///weights/tiny/", "tiny"),
    ],
)
def test_served_name_defaults_to_the_model_folder(uri, served):
    assert weights.served_name({"model": {"uri": uri}}) == served
    assert weights.client_model_name({"model": {"uri": uri}}) == served
    assert weights.client_model_name({"model": {"uri": uri, "servedName": "chat"}}) == "chat"


def test_the_embedded_model_is_named_as_the_server_names_it():
    from pagoda.server.engine.loader import resolve_model_source

    assert weights.served_name({"model": {}}) is None  # the pod gets no PAGODA_SERVED_MODEL_NAME
    assert weights.client_model_name({"model": {}}) == resolve_model_source(None).name


def test_every_pagoda_variable_is_a_pagoda_serve_flag():
    import argparse

    from pagoda.server import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    flags = {"PAGODA_" + a.dest.upper() for a in parser._actions}
    spec = example_spec("full")
    ours = {name for name in env(by_kind(rendered(spec))["Deployment"]) if name.startswith("PAGODA_")}
    user = {e["name"] for e in spec["env"]}
    assert ours - user <= flags, ours - user - flags


def test_no_model_uri_serves_the_embedded_model_on_cpu(monkeypatch):
    """examples/cpu-smollm2.yaml: no uri, no GPU. `pagoda serve` gets no PAGODA_MODEL, so its own
    parser (fed the rendered env) falls back to the embedded SmolLM2 the serving image installs."""
    import argparse

    from pagoda.server import serve_cli
    from pagoda.server.engine.loader import resolve_model_source

    children = by_kind(rendered(example_spec("cpu-smollm2")))
    assert set(children) == {"Deployment", "Service", "ServiceMonitor"}  # no weights PVC, one replica
    pod = children["Deployment"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod and "models" not in {v["name"] for v in pod["volumes"]}
    container = server(children["Deployment"])
    assert all("gpu" not in name for part in container["resources"].values() for name in part)
    variables = {e["name"]: e["value"] for e in container["env"]}
    assert "PAGODA_MODEL" not in variables and "PAGODA_SERVED_MODEL_NAME" not in variables
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.model, args.dtype, args.kv_cache_memory) == (None, "float32", 256 << 20)
    assert resolve_model_source(args.model).name == "SmolLM2-135M-Instruct"


def run_download(tmp_path, marker: bool):
    """The init container's script, run here as the container would (offline: the hub is unreachable)."""
    import subprocess
    import sys

    target = tmp_path / "hf" / "org" / "model" / "v1"
    if marker:
        target.mkdir(parents=True)
        (target / weights.DOWNLOAD_MARKER).write_text("v1")
    env = {
        "PAGODA_MODEL": str(target),
        "HF_REPO_ID": "org/model",
        "HF_REVISION": "v1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_OFFLINE": "1",
        "HOME": str(tmp_path),
    }
    result = subprocess.run(
        [sys.executable, *render.DOWNLOAD_COMMAND[1:]], env=env, capture_output=True, text=True, timeout=60
    )
    return result, target


def test_download_is_skipped_when_the_revision_is_there(tmp_path):
    result, _ = run_download(tmp_path, marker=True)
    assert result.returncode == 0 and "skipping download" in result.stdout


def test_a_failed_download_leaves_no_marker(tmp_path):
    result, target = run_download(tmp_path, marker=False)
    assert result.returncode != 0  # the pod's init container fails: ModelDownloadFailed after restarts
    assert not (target / weights.DOWNLOAD_MARKER).exists()
