"""Dashboards load the same through Grafana's sidecar as through the import wizard: no `${DS_...}`
inputs, every panel and query on the `${datasource}` variable, every query valid PromQL over the metric
names of the docs/metrics.md contract."""

from __future__ import annotations

import json
import re
import sys

import pytest
import yaml
from chart_support import DASHBOARDS, REPO, load_dashboards, panels, queries, run, substitute

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
BOARDS = load_dashboards()


def contract_metric_names() -> set[str]:
    """Series names a serving pod exports, from the table in docs/metrics.md."""
    names = set()
    for name, kind in re.findall(
        r"^\| `(pagoda_\w+)` \| (\w+)", (REPO / "docs" / "metrics.md").read_text(), re.M
    ):
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names


def test_dashboards_exist_and_are_fresh():
    assert set(BOARDS) == {"pagoda-serving.json", "pagoda-memory-vs-compute.json"}
    run(sys.executable, str(REPO / "scripts" / "generate_dashboards.py"), "--check")


@pytest.mark.parametrize("name", BOARDS)
def test_no_import_wizard_placeholders(name):
    text = (DASHBOARDS / name).read_text()
    json.loads(text)
    for placeholder in ("${DS_", "__inputs", "__requires", "__elements"):
        assert placeholder not in text, f"{name} contains {placeholder}"


@pytest.mark.parametrize("name", BOARDS)
def test_every_panel_and_query_uses_the_datasource_variable(name):
    board = BOARDS[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for label in ("namespace", "model_name", "pod"):
        assert variables[label]["type"] == "query" and variables[label]["datasource"] == DATASOURCE
        assert f", {label})" in variables[label]["query"]
    for panel in panels(board):
        assert panel["datasource"] == DATASOURCE, f"{name}: panel {panel['title']}"
        for target in panel.get("targets", []):
            assert target["datasource"] == DATASOURCE, f"{name}: {panel['title']} {target['refId']}"
    assert len({panel["id"] for panel in panels(board)}) == len(list(panels(board)))


@pytest.mark.parametrize("name", BOARDS)
def test_every_query_is_valid_promql(name, promtool, tmp_path):
    """promtool has no query parser of its own: check each expression as a recording rule."""
    values = {"namespace": "(a|b)", "model_name": ".*", "pod": "pod-0"}
    rules = [
        {"record": f"dashboard:query_{i}", "expr": substitute(query.expr, values, "1m")}
        for i, query in enumerate(queries(BOARDS[name], name))
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": name, "rules": rules}]}))
    result = run(promtool, "check", "rules", str(path))
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_metric_names_are_the_contract():
    contract = contract_metric_names()
    for name, board in BOARDS.items():
        for query in queries(board, name):
            for metric in re.findall(r"\b(pagoda_\w+|DCGM_\w+)", query.expr):
                if metric.startswith("pagoda_operator_"):
                    continue  # the operator's own metrics (chart contract), not a serving pod's
                if metric.startswith("DCGM_"):
                    assert name == "pagoda-memory-vs-compute.json", query.where
                    assert metric in {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"}, query.where
                    continue
                assert metric in contract, f"{query.where}: {metric} is not in docs/metrics.md"


def test_serving_dashboard_has_every_panel_of_issue_7():
    exprs = " ".join(q.expr for q in queries(BOARDS["pagoda-serving.json"], "serving"))
    for needed in (
        "pagoda_num_requests_running",
        "pagoda_num_requests_waiting",
        "pagoda_kv_cache_usage_ratio",
        "pagoda_kv_cache_capacity_tokens",
        "rate(pagoda_preemptions_total",
        "rate(pagoda_prefix_cache_hits_total",
        "rate(pagoda_prefix_cache_queries_total",
        "rate(pagoda_prompt_tokens_total",
        "rate(pagoda_generation_tokens_total",
        "pagoda_operator_desired_replicas",
    ):
        assert needed in exprs, needed
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        for q in ("0.5", "0.9", "0.99"):
            assert (
                f"histogram_quantile({q}, sum by (model_name, le) (rate(pagoda_{histogram}_seconds_bucket"
                in exprs
            )


def crd_default_kv_target() -> float:
    crd = yaml.safe_load((REPO / "crds" / "inferenceservices.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["autoscaling"]["properties"]["targetKVCacheUsage"]["default"]


def test_kv_usage_panel_draws_the_autoscaling_target():
    assert crd_default_kv_target() == 0.7  # the line drawn is the CRD's default target
    for name, board in BOARDS.items():
        (panel,) = [p for p in panels(board) if p["title"] == "KV-cache usage per pod"]
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults["thresholds"]["steps"][-1]["value"] == 0.7, name
        assert defaults["custom"]["thresholdsStyle"]["mode"].startswith("line"), name
        assert defaults["unit"] == "percentunit" and defaults["max"] == 1, name


def test_dcgm_panels_explain_an_absent_exporter():
    board = BOARDS["pagoda-memory-vs-compute.json"]
    dcgm_only = [
        p for p in panels(board) if p.get("targets") and all("DCGM_" in t["expr"] for t in p["targets"])
    ]
    assert len(dcgm_only) == 2
    for panel in dcgm_only:
        assert "dcgm-exporter" in panel["fieldConfig"]["defaults"]["noValue"], panel["title"]
    (text,) = [p for p in panels(board) if p["type"] == "text" and p["title"] == "Reading these panels"]
    assert "90%" in text["options"]["content"] and "KV" in text["options"]["content"]


def test_roofline_row_sits_beside_gpu_utilisation_and_explains_both():
    every = list(panels(BOARDS["pagoda-memory-vs-compute.json"]))
    row = [p["title"] for p in every].index("memory-bound or compute-bound?")
    (text,) = [p for p in every[row:] if p["type"] == "text"]
    assert "both readings are true" in text["options"]["content"]
    exprs = [t["expr"] for p in every[row:] for t in p.get("targets", [])]
    assert any("pagoda_step_bytes_total" in e for e in exprs)
    assert any("DCGM_FI_DEV_GPU_UTIL" in e for e in exprs)  # on the same panel as the utilisations
    assert any('bound="memory"' in e for e in exprs)


@pytest.mark.parametrize("name", BOARDS)
def test_panels_fit_the_grid_without_overlapping(name):
    taken: set[tuple[int, int]] = set()
    for panel in panels(BOARDS[name]):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cells & taken, f"{name}: {panel['title']} overlaps another panel"
        taken |= cells
