"""RBAC: the chart's (Cluster)Roles allow every API call the operator makes, and nothing it does not.

The calls are recorded from a run of the real operator against the emulator (the requests kopf's
session sent, told apart from the test's own by User-Agent), through a lifecycle that touches every
child kind. The chart's rbac.yaml is rendered with `helm template` when helm is on PATH or in
.venv/bin; otherwise its rules are read from the template with the template lines stripped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from operator_harness import (
    CR_URL,
    DEP,
    NS,
    PDB,
    PODS_URL,
    SM,
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
)
from support.kube_emulator import KubeEmulator

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagoda"
RBAC_TEMPLATE = CHART / "templates" / "rbac.yaml"
AUTOSCALER_KUBE = ROOT / "operator" / "autoscaling" / "kube.py"

pytestmark = [pytest.mark.kmock(cls=KubeEmulator), pytest.mark.timeout(120)]

Call = tuple[str, str, str, str | None]  # apiGroup, resource[/subresource], verb, namespace (None: cluster)


def recorded_calls(k8s) -> set[Call]:
    calls: set[Call] = set()
    for request in list(k8s):
        if not request.headers.get("User-Agent", "").startswith("kopf/"):
            continue  # the test's own client
        resource = request.resource
        if resource is None or resource.plural is None:
            continue  # discovery (/api, /apis/<group>/<version>): allowed to every authenticated user
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        name = f"{resource.plural}/{request.subresource}" if request.subresource else resource.plural
        if method == "GET":
            verbs = ["watch" if request.params.get("watch") == "true" else "get" if request.name else "list"]
        elif method == "PATCH":
            # a server-side apply that created the object (the emulator marks it) needs create as well
            verbs = ["patch", "create"] if request.action.name == "CREATE" else ["patch"]
        else:
            verbs = [{"POST": "create", "DELETE": "delete", "PUT": "update"}[method]]
        calls |= {(resource.group, name, verb, request.namespace) for verb in verbs}
    return calls


async def lifecycle(k8s, namespaces: list[str] | None) -> None:
    """Create, update, scale, crash, drop the ServiceMonitor, restart: every kind of call once."""
    async with running_operator(k8s, namespaces):
        await create(k8s, isvc(replicas=2, model={"uri": "hf://org/model", "hfTokenSecretRef": {"name": "t"}}))
        await eventually(lambda: live(k8s, PDB, "llm") and condition(k8s, "llm", "ServiceMonitor"))
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"engine": {"maxNumSeqs": 8}}})
        await eventually(lambda: live(k8s, DEP, "llm")["metadata"]["generation"] == 2)
        await patch(k8s, f"{CR_URL}/llm/scale", {"spec": {"replicas": 1}})
        await eventually(lambda: k8s.objects[PDB, NS, "llm"].deleted)
        crash = server_pod(live(k8s, DEP, "llm"), "llm-x", {"state": {"waiting": {"reason": "CrashLoopBackOff"}}})
        await k8s.post(PODS_URL, json=crash)
        await eventually(lambda: condition(k8s, "llm", "Degraded")["reason"] == "CrashLoopBackOff")
        await eventually(lambda: any(e["reason"] == "CrashLoopBackOff" for e in events(k8s)), what="event")
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"monitoring": {"serviceMonitor": False}}})
        await eventually(lambda: k8s.objects[SM, NS, "llm"].deleted)
    async with running_operator(k8s, namespaces):
        await eventually(lambda: live(k8s, DEP, "llm"))


def helm() -> str | None:
    return shutil.which("helm") or shutil.which("helm", path=str(ROOT / ".venv" / "bin"))


def rendered_roles(watch_namespaces: list[str]) -> list[dict]:
    """(Cluster)Role objects for operator.peering=pagoda and these watchNamespaces."""
    if helm():
        args = [helm(), "template", "t", str(CHART), "--show-only", "templates/rbac.yaml",
                "--set", "operator.peering=pagoda"]
        if watch_namespaces:
            args += ["--set", "operator.watchNamespaces={" + ",".join(watch_namespaces) + "}"]
        out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout
        return [d for d in yaml.safe_load_all(out) if d and d["kind"] in ("ClusterRole", "Role")]
    return roles_without_helm(watch_namespaces)


def roles_without_helm(watch_namespaces: list[str]) -> list[dict]:
    """Fallback: the rule lists of rbac.yaml with template lines stripped (peering rules included)."""
    text = RBAC_TEMPLATE.read_text()
    workload = yaml.safe_load(re.sub(r"^\s*\{\{.*\}\}\s*$", "", text.split("{{- end }}")[0].split("-}}", 1)[1],
                                     flags=re.M))
    blocks = [yaml.safe_load(re.sub(r"^\s*\{\{.*\}\}\s*$", "", block, flags=re.M))
              for block in re.findall(r"^rules:\n(.*?)^---", text, flags=re.S | re.M)]
    extra = [[r for r in block or [] if isinstance(r, dict)] for block in blocks]
    if not watch_namespaces:
        return [{"kind": "ClusterRole", "rules": [*workload, *extra[0]]}]
    return [{"kind": "ClusterRole", "rules": extra[1]},
            *({"kind": "Role", "metadata": {"namespace": ns}, "rules": [*workload, *extra[2]]}
              for ns in watch_namespaces)]


def grants(roles: list[dict]) -> set[Call]:
    result: set[Call] = set()
    for role in roles:
        namespace = role.get("metadata", {}).get("namespace") if role["kind"] == "Role" else "*"
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        result.add((group, resource, verb, namespace))
    return result


def allowed(call: Call, granted: set[Call]) -> bool:
    group, resource, verb, namespace = call
    return (group, resource, verb, "*") in granted or (
        namespace is not None and (group, resource, verb, namespace) in granted)


def autoscaler_only_calls() -> set[tuple[str, str, str]]:
    """Calls the autoscaler makes that this run does not trigger (its timer needs real pods to scrape)."""
    source = AUTOSCALER_KUBE.read_text() if AUTOSCALER_KUBE.exists() else ""
    calls = set()
    if '"scale"' in source and "kopf_api.get(" in source:
        calls.add(("serving.pagoda.dev", "inferenceservices/scale", "get"))
    if '"scale"' in source and "kopf_api.patch(" in source:
        calls.add(("serving.pagoda.dev", "inferenceservices/scale", "patch"))
    return calls


@pytest.mark.parametrize("watch_namespaces", [[], [NS]], ids=["cluster-wide", "namespaced"])
async def test_rbac_allows_exactly_the_calls_made(kmock, tmp_path, monkeypatch, watch_namespaces):
    prepare_cluster(kmock, tmp_path, monkeypatch)
    await lifecycle(kmock, watch_namespaces or None)
    calls = recorded_calls(kmock)
    granted = grants(rendered_roles(watch_namespaces))
    assert [c for c in sorted(calls, key=str) if not allowed(c, granted)] == []
    used = {(g, r, v) for g, r, v, _ in calls} | autoscaler_only_calls()
    unused = sorted({(g, r, v) for g, r, v, _ in granted} - used)
    assert unused == [], f"rules the operator never needs: {unused}"
    # kopf's own needs, so a change in kopf shows here first
    verbs = {(r, v) for _, r, v, _ in calls}
    assert {("inferenceservices", "watch"), ("inferenceservices", "patch"), ("events", "create")} <= verbs


def test_the_fallback_parser_reads_the_same_rules_as_helm():
    if helm() is None:
        pytest.skip("helm not installed: the fallback is what the RBAC test uses")
    for namespaces in ([], [NS]):
        assert grants(roles_without_helm(namespaces)) == grants(rendered_roles(namespaces))
