"""What the operator says about faults: a failed model download (the init container's own words, from
the real download module run against a stand-in for the Hub) and a server restarted in place."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from operator_harness import (
    DEP,
    PODS_URL,
    condition,
    create,
    events,
    eventually,
    isvc,
    live,
    prepare_cluster,
    running_operator,
    server_pod,
)
from pagoda.operator import render, status
from support.hub_stub import HubStub
from support.kube_emulator import KubeEmulator

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def k8s(kmock, tmp_path, monkeypatch):
    prepare_cluster(kmock, tmp_path, monkeypatch)
    return kmock


async def failed_download_log(tmp_path) -> str:
    """The init container's output for a repository the hub does not know."""
    hub = HubStub()
    await hub.start()
    try:
        env = {**os.environ, "PAGODA_MODEL": str(tmp_path / "m"), "HF_REPO_ID": "org/missing",
               "HF_REVISION": "main", "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
               "HF_HUB_OFFLINE": "0"}
        process = await asyncio.create_subprocess_exec(
            sys.executable, *render.DOWNLOAD_COMMAND[1:], env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output, _ = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode == 1
        return output.decode()
    finally:
        await hub.stop()


@pytest.mark.kmock(cls=KubeEmulator)
async def test_failed_download_degrades_with_its_cause(k8s, tmp_path):
    log = await failed_download_log(tmp_path)
    async with running_operator(k8s):
        await create(k8s, isvc(model={"uri": "hf://org/missing"}))
        dep = await eventually(lambda: live(k8s, DEP, "llm"))
        pod = server_pod(dep, "llm-a", {"ready": False, "state": {"waiting": {"reason": "PodInitializing"}}},
                         phase="Pending")
        # The kubelet with terminationMessagePolicy FallbackToLogsOnError: the log's tail is the message.
        pod["status"]["initContainerStatuses"] = [{
            "name": render.DOWNLOAD_CONTAINER, "restartCount": 2,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": log[-2048:]}}}]
        await k8s.post(PODS_URL, json=pod)
        degraded = await eventually(lambda: condition(k8s, "llm", "Degraded")["status"] == "True"
                                    and condition(k8s, "llm", "Degraded"), what="Degraded")
        assert degraded["reason"] == "ModelDownloadFailed"
        assert "model download failed: repository not found: org/missing" in degraded["message"]
        await eventually(lambda: any(e["reason"] == "ModelDownloadFailed" and "org/missing" in e["message"]
                                     for e in events(k8s)), what="a Warning Event with the cause")


def restarted(ready: bool) -> dict:
    return {"metadata": {"name": "p"}, "status": {"phase": "Running", "containerStatuses": [{
        "name": "server", "ready": ready, "restartCount": 1, "state": {"running": {}},
        "lastState": {"terminated": {"exitCode": 137, "reason": "Error"}}}]}}


def test_a_restarted_server_degrades_until_ready_again():
    problem = status.pod_problem(restarted(ready=False))
    assert problem is not None and problem.failing and problem.reason == "ServerRestarted"
    assert "code 137" in problem.message and "1 restarts" in problem.message
    assert status.pod_problem(restarted(ready=True)) is None  # serving again: nothing to report


def test_a_pod_that_answers_again_loses_its_error_in_status():
    """status.autoscaling.metrics is merge-patched: keys of the previous round must be removed."""
    from pagoda.operator.autoscaling.scale_status import pod_metrics_patch

    previous = {"p": {"ready": True, "error": "no recent series in prometheus"}, "gone": {"ready": False}}
    patch = pod_metrics_patch({"p": {"ready": True, "kvCacheUsage": 0.5}}, previous)
    assert patch == {"p": {"error": None, "ready": True, "kvCacheUsage": 0.5}}


def test_only_a_whole_source_failure_holds_replicas():
    """Prometheus down (every pod's query failed) is a source failure; one pod without series is not."""
    from pagoda.operator.autoscaling.config import Collection
    from pagoda.operator.autoscaling.handlers import source_failure

    prometheus = Collection(interval_s=15, scrape_timeout_s=2, prometheus_url="http://prometheus:9090")
    down = {"a": "prometheus: ClientConnectorError: refused", "b": "prometheus: ClientConnectorError: refused"}
    assert source_failure(prometheus, down) == down["a"]
    assert source_failure(prometheus, {**down, "b": "no recent series in prometheus"}) is None
    assert source_failure(prometheus, {}) is None  # no ready pod: nothing was asked
    direct = Collection(interval_s=15, scrape_timeout_s=2, prometheus_url=None)
    assert source_failure(direct, {"a": "scrape: timeout"}) is None  # direct scrapes fail per pod
