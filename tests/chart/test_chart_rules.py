"""The alert rules file is valid and its promtool unit tests fire every alert."""

from __future__ import annotations

from pathlib import Path

import yaml
from chart_support import RULES, run

UNIT_TESTS = Path(__file__).with_name("rules_test.yaml")
REQUIRED_ALERTS = {
    "PagodaKVCacheNearlyFull",
    "PagodaRequestQueueGrowing",
    "PagodaTTFTSLOBreached",
    "PagodaServingPodNotReady",
    "PagodaOperatorDown",
}


def test_rules_pass_promtool_check(promtool):
    result = run(promtool, "check", "rules", str(RULES))
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in result.stdout


def test_promtool_unit_tests_fire_every_alert(promtool):
    result = run(promtool, "test", "rules", str(UNIT_TESTS))
    assert "SUCCESS" in result.stdout
    # every alert has a unit test expecting it to fire (exp_alerts not empty)
    fired = {
        case["alertname"]
        for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == REQUIRED_ALERTS


def test_every_alert_has_severity_summary_and_description():
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in rules} == REQUIRED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
