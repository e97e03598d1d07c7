"""The chart installs the same CRD as the top-level crds/ (generated from the schema in code)."""

from __future__ import annotations

import yaml
from chart_support import CHART, REPO


def test_chart_crds_equal_the_top_level_crds():
    top = {p.name: p.read_text() for p in sorted((REPO / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_text() for p in sorted((CHART / "crds").glob("*.yaml"))}
    assert top and chart.keys() == top.keys(), "charts/pagoda/crds/ and crds/ hold different files"
    for name, text in top.items():
        assert yaml.safe_load(chart[name]) == yaml.safe_load(text), f"charts/pagoda/crds/{name} is stale"


def test_the_crd_is_the_contract_one(render):
    (crd,) = [obj for obj in render() if obj["kind"] == "CustomResourceDefinition"]
    assert crd["spec"]["group"] == "serving.pagoda.dev"
    assert crd["spec"]["names"]["kind"] == "InferenceService"
    assert "pisvc" in crd["spec"]["names"]["shortNames"] and "isvc" not in crd["spec"]["names"]["shortNames"]
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]
