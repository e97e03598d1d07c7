"""NOTES.txt tells the user the next three commands, and they point at things that exist."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml
from chart_support import CHART, REPO, run

WRAPPER = """apiVersion: v1
kind: ConfigMap
metadata:
  name: notes-under-test
data:
  notes: {{ include "pagoda.notes-under-test" . | toJson }}
"""


@pytest.fixture(scope="module")
def notes(helm, tmp_path_factory):
    """notes(*helm_args) -> NOTES.txt rendered. `helm install --dry-run` needs a cluster here, so a
    copy of the chart renders NOTES.txt's text inside a ConfigMap through `helm template`."""
    chart = tmp_path_factory.mktemp("notes") / "pagoda"
    shutil.copytree(CHART, chart)
    text = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_under_test.tpl").write_text(
        '{{- define "pagoda.notes-under-test" -}}\n' + text + "{{- end }}\n"
    )
    (chart / "templates" / "notes-under-test.yaml").write_text(WRAPPER)

    def render(*args: str) -> str:
        out = run(
            helm,
            "template",
            "demo",
            str(chart),
            "-n",
            "serving",
            "-s",
            "templates/notes-under-test.yaml",
            *args,
        )
        return yaml.safe_load(out.stdout)["data"]["notes"]

    return render


def test_notes_give_apply_port_forward_and_grafana(notes):
    text = notes()
    values = yaml.safe_load((CHART / "values.yaml").read_text())["notes"]
    example = REPO / "examples" / values["example"]
    assert example.exists(), f"NOTES points at {example}, which does not exist"
    assert yaml.safe_load(example.read_text())["metadata"]["name"] == values["exampleName"]
    assert (
        f"kubectl apply -f https://raw.githubusercontent.com/pagoda-dev/pagoda/v0.1.0/examples/{values['example']}"
        in text
    )
    cpu = REPO / "examples" / values["cpuExample"]
    assert yaml.safe_load(cpu.read_text())["metadata"]["name"] == values["cpuExampleName"]
    assert yaml.safe_load(cpu.read_text())["spec"]["resources"]["gpus"] == 0
    applies = re.findall(r"kubectl apply -f \S+/examples/(\S+)", text)
    assert applies == [values["cpuExample"], values["example"]]  # without a GPU: the first command works
    assert f"kubectl port-forward svc/{values['cpuExampleName']} 8000:8000" in text
    assert f"svc/{values['exampleName']}" in text
    assert "kubectl -n monitoring port-forward svc/kube-prometheus-stack-grafana 3000:80" in text
    (uid,) = re.findall(r"localhost:3000/d/([\w-]+)", text)
    assert uid == json.loads((CHART / "dashboards" / "pagoda-serving.json").read_text())["uid"]
    assert "helm test demo -n serving" in text
    assert "all namespaces" in text and "grafana_dashboard=1" in text


def test_notes_follow_the_values(notes):
    text = notes("--set", "operator.watchNamespaces={a,b}", "--set", "dashboards.enabled=false",
                 "--set", "notes.grafanaNamespace=observability")  # fmt: skip
    assert "watching InferenceServices in: a, b." in text
    assert "grafana_dashboard" not in text
    assert "kubectl -n observability port-forward" in text
