"""The CRD: generated files up to date, a valid structural apiextensions/v1 object, examples accepted,
bad InferenceServices refused (OpenAPI schema via jsonschema + CEL rules via cel-python)."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crd_validation import admission_errors, all_rules, cel_errors, structural_problems
from pagoda.operator import crd, crd_generate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
BAD = sorted((ROOT / "examples" / "bad").glob("*.yaml"))
K8S_VERSION = kubernetes_validate.latest_version()


@pytest.mark.parametrize("output", crd_generate.OUTPUTS)
def test_generated_crd_files_are_up_to_date(output):
    assert (ROOT / output).read_text() == crd_generate.render_yaml(), (
        "stale: run `python -m pagoda.operator.crd_generate --write`"
    )


def test_crd_is_a_valid_apiextensions_object():
    kubernetes_validate.validate(crd.crd(), K8S_VERSION, strict=True)


def test_crd_schema_is_structural():
    assert structural_problems(crd.schema()) == []


def test_crd_names_scale_and_printer_columns():
    spec = crd.crd()["spec"]
    assert spec["names"]["shortNames"] == ["pisvc"] and "isvc" not in spec["names"]["shortNames"]
    version = spec["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["KV"] == ".status.kvCache.usage" and columns["Model"] == ".status.model"
    assert columns["Source"] == ".spec.model.uri"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for path in columns.values():  # every column reads a field the schema declares
        parts = path.lstrip(".").split("[")[0].split(".")
        if parts[0] == "status":
            assert parts[1] in status


def test_every_cel_rule_compiles():
    import celpy

    env = celpy.Environment()
    rules = list(all_rules())
    assert len(rules) >= 5
    for rule in rules:
        env.compile(rule)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted(path):
    obj = yaml.safe_load(path.read_text())
    assert admission_errors(obj) == []


def test_there_are_at_least_ten_kinds_of_bad_specs():
    assert len(BAD) >= 10


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_specs_are_refused_for_the_stated_reason(path):
    text = path.read_text()
    expected = re.search(r"^# expect: (.+)$", text, re.M).group(1).strip()
    errors = admission_errors(yaml.safe_load(text))
    assert errors, f"{path.name} was accepted"
    assert any(expected in e for e in errors), errors


def test_cel_rules_accept_their_edge_cases():
    assert (
        cel_errors(
            {
                "model": {"uri": "hf://o/m"},
                "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 3},
            }
        )
        == []
    )
    assert cel_errors({"model": {"uri": "hf://o/m", "hfTokenSecretRef": {"name": "s"}}}) == []
    assert cel_errors({"model": {"uri": "hf://o/m"}, "autoscaling": {"enabled": False}}) == []
    assert cel_errors({"model": {}}) == []  # no uri: the embedded model
    assert cel_errors({"model": {"hfTokenSecretRef": {"name": "s"}}}) != []  # a token, nothing to download
    cpu_int4 = {"model": {}, "resources": {"gpus": 0}, "engine": {"quantization": "int4"}}
    assert cel_errors(cpu_int4) == []
    assert cel_errors({**cpu_int4, "parallelism": {"nodes": 2}}) != []  # 4-bit layers are not sharded
    assert cel_errors({**cpu_int4, "engine": {"quantization": "gguf", "tensorParallelSize": 2}}) != []
    assert cel_errors({"model": {}, "engine": {"quantization": "none"}}) == []  # on the default GPU


@pytest.mark.parametrize(
    ("uri", "ok"),
    [
        ("hf://org/name", True),
        ("hf://org/name@v1.0", True),
        ("hf://org/na.me@refs/pr/1", True),
        ("pvc://claim/path/to/model", True),
        ("pvc://claim", True),
        ("file:///weights", True),
        ("hf://name", False),
        ("hf:///org/name", False),
        ("pvc://Claim/x", False),
        ("file://rel", False),
        ("https://huggingface.co/org/name", False),
    ],
)
def test_model_uri_pattern(uri, ok):
    assert (re.fullmatch(crd.MODEL_URI_PATTERN, uri) is not None) is ok


def test_defaults_fill_sections_the_user_left_out():
    spec = crd.with_defaults({"model": {"uri": "hf://o/m"}})
    assert spec["engine"]["blockSize"] == 16 and spec["autoscaling"]["targetKVCacheUsage"] == 0.7
    assert spec["replicas"] == 1 and spec["monitoring"]["serviceMonitor"] is True
    assert "hfTokenSecretRef" not in spec["model"]  # objects without `default` are not invented


def test_doc_reference_is_the_generated_one():
    doc = (ROOT / "docs" / "inferenceservice.md").read_text()
    section = doc.split("<!-- reference:begin -->\n", 1)[1].split("<!-- reference:end -->", 1)[0]
    assert section == crd_generate.markdown_reference(), "regenerate with `python -m pagoda.operator.crd_generate --markdown`"


def test_doc_reference_lists_every_spec_field():
    def paths(node, prefix):
        for name, child in node.get("properties", {}).items():
            yield f"{prefix}.{name}"
            items = child.get("items", {})
            yield from paths(child, f"{prefix}.{name}") if "properties" in child else ()
            yield from paths(items, f"{prefix}.{name}[]") if "properties" in items else ()

    reference = crd_generate.markdown_reference()
    missing = [p for p in paths(crd.schema()["properties"]["spec"], "spec") if f"| `{p}` |" not in reference]
    assert missing == []
