"""`pagoda operator`: the flags of the chart contract, and what they turn into."""

from __future__ import annotations

import pytest

from pagoda import cli


def parse(*argv: str):
    return cli.build_parser().parse_args(["operator", *argv])


def test_contract_flags_parse():
    args = parse(
        "--namespace=ml", "--namespace=prod", "--health-port=8080", "--metrics-port=8081", "--peering=pagoda"
    )
    assert args.namespace == ["ml", "prod"] and not args.all_namespaces
    assert (args.health_port, args.metrics_port, args.peering, args.standalone) == (
        8080,
        8081,
        "pagoda",
        False,
    )
    args = parse("--all-namespaces", "--standalone")
    assert args.all_namespaces and args.standalone and args.namespace == []


@pytest.mark.parametrize(
    "argv", [[], ["--all-namespaces", "--namespace=ml"], ["--all-namespaces", "--peering=x", "--standalone"]]
)
def test_scope_and_peering_are_explicit_and_exclusive(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)


def test_main_runs_kopf_with_the_parsed_settings(monkeypatch):
    # kopf.run would block serving a cluster: record its arguments instead (the only thing mocked).
    import kopf
    import prometheus_client
    from pagoda.operator import handlers

    seen: dict = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: seen.update(kw))
    monkeypatch.setattr(prometheus_client, "start_http_server", lambda port: seen.update(metrics=port))
    monkeypatch.setattr(handlers, "CONFIG", handlers.OperatorConfig())
    assert cli.main(["operator", "--namespace=ml", "--peering=pagoda", "--status-interval=3"]) == 0
    assert seen["namespaces"] == ["ml"] and seen["clusterwide"] is False
    assert seen["peering_name"] == "pagoda" and seen["standalone"] is None
    assert seen["priority"] > 0  # random: two replicas never share the top priority (kopf would pause both)
    assert seen["liveness_endpoint"] == "http://0.0.0.0:8080/healthz" and seen["metrics"] == 8081
    assert handlers.CONFIG.status_interval == 3


def test_default_image_comes_from_the_environment(monkeypatch):
    from pagoda.operator.handlers import OperatorConfig

    monkeypatch.setenv("PAGODA_SERVER_IMAGE", "registry.test/server:9")
    assert OperatorConfig().image() == "registry.test/server:9"
    assert OperatorConfig(default_image="x/y:1").image() == "x/y:1"
