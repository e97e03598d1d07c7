"""The chart installs the same CRDs as the top-level crds/: the InferenceService CRD (generated from the
schema in code) and kopf's peering CRDs."""

from __future__ import annotations

import yaml
from chart_support import CHART, REPO


def test_chart_crds_equal_the_top_level_crds():
    top = {p.name: p.read_text() for p in sorted((REPO / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_text() for p in sorted((CHART / "crds").glob("*.yaml"))}
    assert top and chart.keys() == top.keys(), "charts/pagoda/crds/ and crds/ hold different files"
    for name, text in top.items():
        assert list(yaml.safe_load_all(chart[name])) == list(yaml.safe_load_all(text)), (
            f"charts/pagoda/crds/{name} is stale"
        )


def test_the_crd_is_the_contract_one(render):
    crds = [obj for obj in render() if obj["kind"] == "CustomResourceDefinition"]
    (crd,) = [obj for obj in crds if obj["spec"]["group"] == "serving.pagoda.dev"]
    assert {obj["spec"]["group"] for obj in crds} == {"serving.pagoda.dev", "kopf.dev"}
    assert crd["spec"]["names"]["kind"] == "InferenceService"
    assert "pisvc" in crd["spec"]["names"]["shortNames"] and "isvc" not in crd["spec"]["names"]["shortNames"]
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]


def test_the_peering_crds_are_the_ones_kopf_uses(render):
    """kopf's own peering selectors match them (so `--peering` finds them), with the scope kopf peers
    in, and a status that keeps what kopf writes there (one key per operator replica)."""
    from pagoda.operator.kube import peering_references as references

    peerings = [
        obj
        for obj in render()
        if obj["kind"] == "CustomResourceDefinition" and obj["spec"]["group"] == "kopf.dev"
    ]
    scopes = {}
    for crd in peerings:
        (version,) = crd["spec"]["versions"]
        names = crd["spec"]["names"]
        assert (
            crd["metadata"]["name"] == f"{names['plural']}.kopf.dev"
            and version["served"]
            and version["storage"]
        )
        resource = references.Resource(
            group="kopf.dev",
            version=version["name"],
            plural=names["plural"],
            kind=names["kind"],
            singular=names["singular"],
        )
        (selector,) = [
            s for s in (references.CLUSTER_PEERINGS_K, references.NAMESPACED_PEERINGS_K) if s.check(resource)
        ]
        scopes[selector] = crd["spec"]["scope"]
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert scopes == {
        references.CLUSTER_PEERINGS_K: "Cluster",
        references.NAMESPACED_PEERINGS_K: "Namespaced",
    }
