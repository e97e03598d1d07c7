"""The chart lints, renders valid Kubernetes objects in every mode, and its schema refuses bad values."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_support import CHART, RULES, run

K8S_VERSION = "1.33.0"
ALL_FEATURES = [
    "--set",
    "serviceMonitor.enabled=true",
    "--set",
    "serviceMonitor.labels.release=kube-prometheus-stack",
    "--set",
    "prometheusRule.enabled=true",
    "--set",
    "prometheusRule.labels.release=kube-prometheus-stack",
    "--set",
    "prometheusRule.ttftP99SloSeconds=1.5",
    "--set",
    "dashboards.folder=LLM serving",
    "--set",
    "dashboards.namespace=monitoring",
    "--set",
    "dashboards.label=grafana_dashboard",
    "--set-string",
    "dashboards.labelValue=pagoda",
    "--set",
    "operator.peering=pagoda",
    "--set",
    "operator.replicas=2",
    "--set",
    "operator.priorityClassName=system-cluster-critical",
    "--set",
    "operator.nodeSelector.kubernetes\\.io/os=linux",
    "--set",
    "operator.imagePullSecrets[0].name=regcred",
    "--set",
    "operator.extraEnv[0].name=KOPF_LOG_LEVEL",
    "--set",
    "operator.extraEnv[0].value=debug",
]
NAMESPACED_PEERED = [
    "--set",
    "operator.watchNamespaces={a,b}",
    "--set",
    "operator.peering=pagoda",
    "--set",
    "operator.replicas=2",
]
MODES = {
    "default": [],
    "namespaced": ["--set", "operator.watchNamespaces={a,b}"],
    "all-features": ALL_FEATURES,
    "namespaced-peered": NAMESPACED_PEERED,
}
PEERED_MODES = {"all-features", "namespaced-peered"}

# Prometheus Operator kinds: no schema in kubernetes_validate (they are CRDs); their CRDs cannot be
# fetched here, so this checks the fields the chart sets, as the CRDs define them.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "honorLabels": {"type": "boolean"},
                            "path": {"type": "string"},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "scrapeTimeout": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "action": {
                                            "enum": [
                                                "replace",
                                                "keep",
                                                "drop",
                                                "labelmap",
                                                "labeldrop",
                                                "labelkeep",
                                            ]
                                        },
                                        "targetLabel": {"type": "string"},
                                        "replacement": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["alert", "expr"],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "expr": {"type": "string"},
                                        "for": {
                                            "type": "string",
                                            "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                                        },
                                        "labels": {
                                            "type": "object",
                                            "additionalProperties": {"type": "string"},
                                        },
                                        "annotations": {
                                            "type": "object",
                                            "additionalProperties": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}
CRD_BASED = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA, "PrometheusRule": PROMETHEUS_RULE_SCHEMA}


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def check_custom_resource(obj: dict, crds: list[dict]) -> None:
    """An object of a kind the chart's own crds/ define (kopf's peering objects): right group, version
    and scope, and valid against that CRD's schema (unknown fields refused, as kubectl's strict mode)."""
    group, version = obj["apiVersion"].split("/")
    (crd,) = [c for c in crds if c["spec"]["group"] == group and c["spec"]["names"]["kind"] == obj["kind"]]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    assert ("namespace" in obj["metadata"]) == (crd["spec"]["scope"] == "Namespaced"), obj["metadata"]
    schema = {**served["schema"]["openAPIV3Schema"], "additionalProperties": False}
    schema["properties"] = {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        **schema["properties"],
    }
    jsonschema.validate(obj, schema)


def test_helm_lint_strict(helm):
    for args in MODES.values():
        result = run(helm, "lint", "--strict", str(CHART), *args)
        assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("mode", MODES)
def test_every_rendered_object_is_valid(render, mode, promtool, tmp_path):
    objects = render(*MODES[mode])
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "ServiceAccount", "Service", "ConfigMap", "Pod"} <= kinds
    own_crds = by_kind(objects, "CustomResourceDefinition")
    own_kinds = {crd["spec"]["names"]["kind"] for crd in own_crds}
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CRD_BASED:
            jsonschema.validate(obj, CRD_BASED[obj["kind"]])
        elif obj["kind"] in own_kinds:
            check_custom_resource(obj, own_crds)
        else:
            try:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{mode}: {where}: {error.message} at {list(error.path)}")
        labels = obj["metadata"].get("labels", {})
        if obj["kind"] != "CustomResourceDefinition":
            assert labels.get("app.kubernetes.io/instance") == "pagoda", where
            assert labels.get("app.kubernetes.io/managed-by") == "Helm", where
            assert labels.get("app.kubernetes.io/name") == "pagoda", where
    for rule in by_kind(objects, "PrometheusRule"):  # the rendered rules are valid rules too
        path = tmp_path / "rendered-rules.yaml"
        path.write_text(yaml.safe_dump(rule["spec"]))
        run(promtool, "check", "rules", str(path))


def operator_container(objects: list[dict]) -> dict:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_operator_args_follow_the_contract(render):
    cluster_wide = operator_container(render())
    assert cluster_wide["args"] == [
        "operator",
        "--all-namespaces",
        "--health-port=8080",
        "--metrics-port=8081",
        "--standalone",
    ]
    namespaced = operator_container(render(*MODES["namespaced"]))
    assert namespaced["args"][:3] == ["operator", "--namespace=a", "--namespace=b"]
    assert "--all-namespaces" not in namespaced["args"]
    peered = operator_container(render(*ALL_FEATURES))
    assert "--peering=pagoda" in peered["args"] and "--standalone" not in peered["args"]
    env = {e["name"]: e.get("value") for e in cluster_wide["env"]}
    assert env["PAGODA_SERVER_IMAGE"] == "ghcr.io/pagoda-dev/pagoda-server:0.1.0"
    assert cluster_wide["image"] == "ghcr.io/pagoda-dev/pagoda-operator:0.1.0"


@pytest.mark.parametrize("mode", MODES)
def test_operator_args_parse_with_the_real_cli(render, mode):
    """The Deployment's args are accepted by `pagoda operator`'s own parser, meaning what they say."""
    from pagoda.cli import build_parser

    container = operator_container(render(*MODES[mode]))
    assert container["args"][0] == "operator"
    args = build_parser().parse_args(container["args"])
    assert (args.health_port, args.metrics_port) == (8080, 8081)
    assert args.all_namespaces == (not mode.startswith("namespaced"))
    assert args.namespace == (["a", "b"] if mode.startswith("namespaced") else [])
    assert (args.peering, args.standalone) == (("pagoda", False) if mode in PEERED_MODES else (None, True))


@pytest.mark.parametrize("mode", MODES)
def test_peering_objects_are_the_ones_the_operator_patches(render, mode):
    """With operator.peering, the object kopf peers in exists: the ClusterKopfPeering named so when the
    operator serves all namespaces, else a KopfPeering in each watched namespace (kopf patches them,
    never creates them). Standalone: none."""
    objects = render(*MODES[mode])
    peerings = {
        (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        for obj in objects
        if obj["apiVersion"] == "kopf.dev/v1"
    }
    args = operator_container(objects)["args"]
    if mode not in PEERED_MODES:
        assert peerings == set() and "--standalone" in args
        return
    assert "--peering=pagoda" in args
    if mode.startswith("namespaced"):
        assert peerings == {("KopfPeering", "a", "pagoda"), ("KopfPeering", "b", "pagoda")}
    else:
        assert peerings == {("ClusterKopfPeering", None, "pagoda")}


def test_operator_is_locked_down(render):
    objects = render()
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"health": 8080, "metrics": 8081}
    assert container["resources"]["limits"] and container["resources"]["requests"]
    assert pod["serviceAccountName"] == "pagoda"


def test_helm_test_pod_calls_the_health_endpoint_through_the_service(render):
    objects = render()
    (test_pod,) = by_kind(objects, "Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = test_pod["spec"]["containers"][0]["command"][-1]
    (service,) = by_kind(objects, "Service")
    assert f"http://{service['metadata']['name']}.pagoda-system.svc:8080/healthz" in script
    compile(script, "helm-test", "exec")  # the inline check is valid Python
    assert {p["name"] for p in service["spec"]["ports"]} == {"health", "metrics"}


def test_dashboards_configmaps_carry_the_sidecar_label_and_folder(render):
    default = by_kind(render(), "ConfigMap")
    assert len(default) == len(list((CHART / "dashboards").glob("*.json"))) >= 2
    for configmap in default:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert "annotations" not in configmap["metadata"]
        ((name, text),) = configmap["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / name).read_text())
    custom = by_kind(render(*ALL_FEATURES), "ConfigMap")
    for configmap in custom:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "pagoda"
        assert configmap["metadata"]["annotations"]["grafana_folder"] == "LLM serving"
        assert configmap["metadata"]["namespace"] == "monitoring"
    assert not by_kind(render("--set", "dashboards.enabled=false"), "ConfigMap")


def test_prometheus_rule_is_the_plain_rules_file_with_the_slo_value(render):
    plain = yaml.safe_load(RULES.read_text())
    assert not by_kind(render(), "PrometheusRule")
    (default,) = by_kind(render("--set", "prometheusRule.enabled=true"), "PrometheusRule")
    assert default["spec"] == plain
    (custom,) = by_kind(render(*ALL_FEATURES), "PrometheusRule")
    rules = {rule["alert"]: rule for group in custom["spec"]["groups"] for rule in group["rules"]}
    assert "> 1.5  # values: prometheusRule.ttftP99SloSeconds" in rules["PagodaTTFTSLOBreached"]["expr"]
    assert custom["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_service_monitor_sets_the_job_the_operator_down_alert_selects(render):
    (monitor,) = by_kind(render(*ALL_FEATURES), "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert {"action": "replace", "targetLabel": "job", "replacement": "pagoda-operator"} in endpoint[
        "relabelings"
    ]
    assert 'job="pagoda-operator"' in RULES.read_text()


BAD_VALUES = {
    "negative replicas": ["--set", "operator.replicas=-1"],
    "namespace not a DNS label": ["--set", "operator.watchNamespaces={Bad_NS}"],
    "writable root filesystem": ["--set", "operator.securityContext.readOnlyRootFilesystem=false"],
    "root user": ["--set", "operator.podSecurityContext.runAsNonRoot=false"],
    "port out of range": ["--set", "operator.healthPort=70000"],
    "unknown key": ["--set", "operator.replicaCount=2"],
    "SLO not positive": ["--set", "prometheusRule.ttftP99SloSeconds=0"],
    "SLO not a number": ["--set", "prometheusRule.ttftP99SloSeconds=fast"],
    "bad scrape interval": ["--set", "serviceMonitor.interval=soon"],
    "bad pull policy": ["--set", "operator.image.pullPolicy=Sometimes"],
    "label value not a string": ["--set", "dashboards.labelValue=1"],
    "rbac.create not a bool": ["--set-string", "rbac.create=yes"],
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_are_refused_by_the_schema(helm, case):
    result = run(helm, "template", "pagoda", str(CHART), *BAD_VALUES[case], check=False)
    assert result.returncode != 0, f"{case}: accepted"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr


def test_two_replicas_without_peering_are_refused(helm):
    result = run(helm, "template", "pagoda", str(CHART), "--set", "operator.replicas=2", check=False)
    assert result.returncode != 0 and "needs operator.peering" in result.stderr
