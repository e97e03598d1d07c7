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
    LWS,
    NS,
    PDB,
    PEERING,
    PODS_URL,
    POOL,
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


def peering_patches(k8s) -> set[tuple[str, str | None, str]]:
    """(plural, namespace, name) of every peering object kopf's session patched."""
    return {
        (r.resource.plural, r.namespace, r.name)
        for r in list(k8s)
        if r.headers.get("User-Agent", "").startswith("kopf/")
        and r.resource is not None
        and r.resource.group == "kopf.dev"
        and str(getattr(r.method, "value", r.method)).upper() == "PATCH"
    }


async def lifecycle(k8s, namespaces: list[str] | None, peering: str | None) -> None:
    """Create, update, scale, crash, drop the ServiceMonitor, a multi-node group and back, restart:
    every kind of call once."""
    async with running_operator(k8s, namespaces, peering=peering):
        await create(
            k8s, isvc(replicas=2, model={"uri": "hf://org/model", "hfTokenSecretRef": {"name": "t"}})
        )
        await eventually(lambda: live(k8s, PDB, "llm") and condition(k8s, "llm", "ServiceMonitor"))
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"engine": {"maxNumSeqs": 8}}})
        await eventually(lambda: live(k8s, DEP, "llm")["metadata"]["generation"] == 2)
        await patch(k8s, f"{CR_URL}/llm/scale", {"spec": {"replicas": 1}})
        await eventually(lambda: k8s.objects[PDB, NS, "llm"].deleted)
        crash = server_pod(
            live(k8s, DEP, "llm"), "llm-x", {"state": {"waiting": {"reason": "CrashLoopBackOff"}}}
        )
        await k8s.post(PODS_URL, json=crash)
        await eventually(lambda: condition(k8s, "llm", "Degraded")["reason"] == "CrashLoopBackOff")
        await eventually(lambda: any(e["reason"] == "CrashLoopBackOff" for e in events(k8s)), what="event")
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"monitoring": {"serviceMonitor": False}}})
        await eventually(lambda: k8s.objects[SM, NS, "llm"].deleted)
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"routing": {"inferencePool": {"enabled": True}}}})
        await eventually(lambda: live(k8s, POOL, "llm"))
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"routing": {"inferencePool": {"enabled": False}}}})
        await eventually(lambda: k8s.objects[POOL, NS, "llm"].deleted)
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"parallelism": {"nodes": 2}}})
        await eventually(lambda: live(k8s, LWS, "llm") and k8s.objects[DEP, NS, "llm"].deleted)
        await patch(k8s, f"{CR_URL}/llm", {"spec": {"parallelism": {"nodes": 1}}})
        await eventually(lambda: live(k8s, DEP, "llm") and k8s.objects[LWS, NS, "llm"].deleted)
    async with running_operator(k8s, namespaces, peering=peering):
        await eventually(lambda: live(k8s, DEP, "llm"))


def helm() -> str | None:
    return shutil.which("helm") or shutil.which("helm", path=str(ROOT / ".venv" / "bin"))


def rendered_chart(watch_namespaces: list[str], peering: str | None) -> list[dict]:
    """The chart's objects for these values of operator.watchNamespaces and operator.peering."""
    args = [helm(), "template", "t", str(CHART)]
    if peering:
        args += ["--set", f"operator.peering={peering}"]
    if watch_namespaces:
        args += ["--set", "operator.watchNamespaces={" + ",".join(watch_namespaces) + "}"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def rendered_roles(watch_namespaces: list[str], peering: str | None) -> list[dict]:
    """(Cluster)Role objects for these watchNamespaces, peered (operator.peering) or standalone."""
    if helm():
        return [d for d in rendered_chart(watch_namespaces, peering) if d["kind"] in ("ClusterRole", "Role")]
    roles = roles_without_helm(watch_namespaces)
    if not peering:  # the fallback cannot evaluate `if $peering`: drop the peering rules by hand
        for role in roles:
            role["rules"] = [r for r in role["rules"] if r["apiGroups"] != ["kopf.dev"]]
    return roles


def roles_without_helm(watch_namespaces: list[str]) -> list[dict]:
    """Fallback: the rule lists of rbac.yaml with template lines stripped (peering rules included)."""
    text = RBAC_TEMPLATE.read_text()
    workload = yaml.safe_load(
        re.sub(r"^\s*\{\{.*\}\}\s*$", "", text.split("{{- end }}")[0].split("-}}", 1)[1], flags=re.M)
    )
    blocks = [
        yaml.safe_load(re.sub(r"^\s*\{\{.*\}\}\s*$", "", block, flags=re.M))
        for block in re.findall(r"^rules:\n(.*?)^---", text, flags=re.S | re.M)
    ]
    extra = [[r for r in block or [] if isinstance(r, dict)] for block in blocks]
    if not watch_namespaces:
        return [{"kind": "ClusterRole", "rules": [*workload, *extra[0]]}]
    return [
        {"kind": "ClusterRole", "rules": extra[1]},
        *(
            {"kind": "Role", "metadata": {"namespace": ns}, "rules": [*workload, *extra[2]]}
            for ns in watch_namespaces
        ),
    ]


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
        namespace is not None and (group, resource, verb, namespace) in granted
    )


def autoscaler_only_calls() -> set[tuple[str, str, str]]:
    """Calls the autoscaler makes that this run does not trigger (its timer needs real pods to scrape)."""
    source = AUTOSCALER_KUBE.read_text() if AUTOSCALER_KUBE.exists() else ""
    calls = set()
    if '"scale"' in source and "get_existing(" in source:
        calls.add(("serving.pagoda.dev", "inferenceservices/scale", "get"))
    if '"scale"' in source and "await patch(" in source:
        calls.add(("serving.pagoda.dev", "inferenceservices/scale", "patch"))
    return calls


@pytest.mark.parametrize("peering", [PEERING, None], ids=["peered", "standalone"])
@pytest.mark.parametrize("watch_namespaces", [[], [NS]], ids=["cluster-wide", "namespaced"])
async def test_rbac_allows_exactly_the_calls_made(kmock, tmp_path, monkeypatch, watch_namespaces, peering):
    prepare_cluster(kmock, tmp_path, monkeypatch)
    await lifecycle(kmock, watch_namespaces or None, peering)
    calls = recorded_calls(kmock)
    granted = grants(rendered_roles(watch_namespaces, peering))
    assert [c for c in sorted(calls, key=str) if not allowed(c, granted)] == []
    used = {(g, r, v) for g, r, v, _ in calls} | autoscaler_only_calls()
    unused = sorted({(g, r, v) for g, r, v, _ in granted} - used)
    assert unused == [], f"rules the operator never needs: {unused}"
    # kopf's own needs, so a change in kopf shows here first
    verbs = {(r, v) for _, r, v, _ in calls}
    assert {("inferenceservices", "watch"), ("inferenceservices", "patch"), ("events", "create")} <= verbs
    peering_plural = "kopfpeerings" if watch_namespaces else "clusterkopfpeerings"
    assert ({(peering_plural, "watch"), (peering_plural, "patch")} <= verbs) == bool(peering)


@pytest.mark.parametrize("watch_namespaces", [[], [NS]], ids=["cluster-wide", "namespaced"])
async def test_kopf_peers_in_the_objects_the_chart_creates(kmock, tmp_path, monkeypatch, watch_namespaces):
    """kopf patches exactly the peering objects the chart renders for operator.peering: the
    ClusterKopfPeering cluster-wide, the KopfPeering of each watched namespace otherwise."""
    if helm() is None:
        pytest.skip("helm not installed: the chart's peering objects cannot be rendered")
    prepare_cluster(kmock, tmp_path, monkeypatch)
    async with running_operator(kmock, watch_namespaces or None):
        await eventually(lambda: peering_patches(kmock), what="a peering patch")
    chart = {
        (f"{d['kind'].lower()}s", d["metadata"].get("namespace"), d["metadata"]["name"])
        for d in rendered_chart(watch_namespaces, PEERING)
        if d["apiVersion"].startswith("kopf.dev/")
    }
    assert peering_patches(kmock) == chart
    assert chart == (
        {("kopfpeerings", NS, PEERING)} if watch_namespaces else {("clusterkopfpeerings", None, PEERING)}
    )


def test_the_fallback_parser_reads_the_same_rules_as_helm():
    if helm() is None:
        pytest.skip("helm not installed: the fallback is what the RBAC test uses")
    for namespaces in ([], [NS]):
        for peering in (PEERING, None):
            helm_roles = [
                d for d in rendered_chart(namespaces, peering) if d["kind"] in ("ClusterRole", "Role")
            ]
            assert grants(rendered_roles(namespaces, peering)) == grants(helm_roles)
            if peering:
                assert grants(roles_without_helm(namespaces)) == grants(helm_roles)
