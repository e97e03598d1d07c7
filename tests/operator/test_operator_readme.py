"""The README's cluster path stays true where it can be checked without a cluster: `helm template` of
exactly its `helm install` renders valid objects, every example it applies passes its schema, and the
names it then uses (`kubectl get pisvc`, the Service it port-forwards, the model it asks for, the
dashboards it opens) are the ones those objects have. The curl and SDK calls run in
tests/server/test_server_readme.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from crd_validation import admission_errors, foreign_admission_errors
from pagoda.operator import crd, render, weights
from support.readme_cluster_path import ROOT, blocks, command, inline_applies, section
from test_operator_routing import KEDA_SCHEMA

NAMESPACE = "ml"


def helm() -> str:
    path = shutil.which("helm") or shutil.which("helm", path=str(ROOT / ".venv" / "bin"))
    if path is None:
        pytest.fail("helm not found: run scripts/get-helm.sh (scripts/setup.sh --dev does)", pytrace=False)
    return path


def test_the_helm_install_renders_valid_objects():
    (install,) = command("helm", "install")
    release, chart, *flags = install[2:]
    assert (ROOT / chart / "Chart.yaml").exists()
    flags = [f for f in flags if f != "--create-namespace"]  # `helm template` has nothing to create
    out = subprocess.run([helm(), "template", release, str(ROOT / chart), *flags, "--include-crds"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    objects = [d for d in yaml.safe_load_all(out) if d]
    namespace = flags[flags.index("--namespace") + 1]
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "ConfigMap"} <= kinds
    assert any(o["kind"] == "CustomResourceDefinition" and o["spec"]["group"] == crd.GROUP for o in objects)
    for obj in objects:
        if obj["kind"] in ("Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service"):
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        if obj["kind"] == "Deployment":
            assert obj["metadata"]["namespace"] == namespace


def applied_examples() -> dict[str, dict]:
    """path -> the object, for every `kubectl apply -n ml -f <file>` of the section."""
    examples = {}
    for words in command("kubectl", "apply") + inline_applies():
        assert words[words.index("-n") + 1] == NAMESPACE, words
        path = words[words.index("-f") + 1]
        examples[path] = yaml.safe_load((ROOT / path).read_text())
    return examples


def test_every_applied_example_passes_its_schema():
    examples = applied_examples()
    assert {"examples/cpu-smollm2.yaml", "examples/inference-pool.yaml", "examples/keda/scaledobject.yaml"} <= set(examples)
    for path, obj in examples.items():
        if obj["kind"] == crd.KIND:
            assert admission_errors(obj) == [], path
        else:
            assert obj["kind"] == "ScaledObject" and foreign_admission_errors(obj, KEDA_SCHEMA) == [], path
    namespace_created = command("kubectl", "create", "namespace")
    assert [c[3] for c in namespace_created] == [NAMESPACE]


def test_the_names_used_after_the_apply_are_the_example_s():
    (apply,) = command("kubectl", "apply")
    example = yaml.safe_load((ROOT / apply[apply.index("-f") + 1]).read_text())
    name = example["metadata"]["name"]
    (get,) = command("kubectl", "get")
    assert get[2] in crd.SHORT_NAMES and get[-2:] == [name, "-w"]
    owner = render.Owner(name=name, namespace=NAMESPACE, uid="u")
    desired = render.render(owner, crd.with_defaults(example["spec"]), default_image="img", service_monitors_served=True)
    services = {o["metadata"]["name"]: o for o in desired.objects if o["kind"] == "Service"}
    forwards = [c for c in command("kubectl", "port-forward") if c[c.index("-n") + 1] == NAMESPACE]
    (forward,) = forwards
    target, ports = forward[-2], forward[-1]
    assert target == f"svc/{name}" and name in services
    assert int(ports.split(":")[1]) == services[name]["spec"]["ports"][0]["port"] == render.SERVER_PORT
    (curl,) = command("curl")
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["model"] == weights.client_model_name(example["spec"])
    assert f'model="{weights.client_model_name(example["spec"])}"' in blocks("python")[0]


def test_the_dashboards_it_opens_exist():
    uids = {json.loads(p.read_text())["uid"] for p in (ROOT / "charts/pagoda/dashboards").glob("*.json")}
    opened = set(re.findall(r"/d/([a-z0-9-]+)", section()))
    assert opened == {"pagoda-serving", "pagoda-memory-vs-compute"} and opened <= uids
