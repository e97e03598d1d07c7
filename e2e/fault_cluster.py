"""Faults of the cluster's moving parts, one at a time under a steady load, on the local stand-ins for a
cluster (e2e/README.md): kmock's emulator over HTTP, the real `pagoda operator` process, real
`pagoda serve` pods (e2e/pod_runner.py), the round-robin front as the Service, a real Prometheus
as the autoscaler's metrics source, and OpenAI-client users (e2e/load.py).

The InferenceService: 2 replicas, autoscaling on (min 1, max 2, interval 2 s, reading Prometheus),
servers whose KV cache holds one request each, so the closed-loop users keep both busy. In order:
1. pod-kill: SIGKILL one server mid-stream. Its streams break (a clean error, long before the
   client's timeout); the other pod's requests all succeed; the operator says Degraded
   (ServerRestarted) until the restarted container is ready, then Ready; the autoscaler never
   proposes fewer than 2 replicas while the pod's metrics are missing.
2. operator-restart: SIGKILL the operator under load, start it again. Nothing changes for users;
   spec.replicas holds, no child is duplicated or orphaned, status keeps being written.
3. operator-scale-up: maxReplicas 2 → 3; the operator is SIGKILLed the moment the autoscaler wrote
   spec.replicas = 3, and restarted. The scale-up completes once, with no flapping.
4. prometheus-outage: the load stops and Prometheus goes down for `outage_s` (longer than the
   scale-down window). Replicas hold, with a Warning Event and the reason in status; once it is back
   the idle servers are scaled down (scaling resumes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import kmock
from pagoda.operator import crd
from support.kube_emulator import KubeEmulator, declare_builtin_resources, declare_crd
from support.prometheus import PrometheusServer

from e2e.fault_plot import plot_fault
from e2e.front import RoundRobinFront
from e2e.load import Load, RequestRecord, outcome
from e2e.local import CR_PATH, NAME, NAMESPACE, start_operator
from e2e.pod_runner import PodRunner, Replica

CLIENTS = 8  # closed-loop users: enough that 2 servers of 16 blocks stay above the KV target
THINK_S = 0.5  # each user waits a random 0..0.5 s before its next request
TIMEOUT_S = 60.0  # the clients' timeout: a fault must end a request well before it
RESOURCE = f"{crd.API_VERSION}/{crd.PLURAL}"


@dataclass
class ClusterSample:
    t: float
    spec_replicas: int  # what the autoscaler wrote
    ready_pods: int  # serving processes answering /ready
    ready: int  # the Ready condition (1 = True)
    degraded: int  # the Degraded condition (1 = True)
    degraded_reason: str
    proposal: int | None  # the autoscaler's highest proposal
    autoscaling_reason: str
    operator_up: int
    prometheus_up: int
    pod_metrics: str = ""  # status.autoscaling.metrics: what the autoscaler read per pod


def inference_service(model_dir: Path, prometheus_url: str, down_window: int) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"model": {"uri": f"file://{model_dir}", "servedName": NAME}, "replicas": 2,
                     "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
                     "engine": {"dtype": "float32", "maxNumSeqs": 16,
                                "extraArgs": ["--num-blocks", "16", "--drain-timeout", "30"]},
                     "drainTimeoutSeconds": 30,
                     "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                     "targetKVCacheUsage": 0.7, "targetQueueDepth": 4, "intervalSeconds": 2,
                                     "scrapeTimeoutSeconds": 1, "scaleDownStabilizationSeconds": down_window,
                                     "prometheusURL": prometheus_url},
                     "monitoring": {"serviceMonitor": False}}}


class Cluster:
    def __init__(self, model_dir: Path, out: Path) -> None:
        self.model_dir, self.out = model_dir, out
        self.t0 = time.monotonic()
        self.samples: list[ClusterSample] = []
        self.operator: subprocess.Popen | None = None
        self.operator_starts = 0
        self.prometheus_up = True

    def now(self) -> float:
        # not rounded: a stream that ends within 10 ms of a kill must still order after it
        return time.monotonic() - self.t0

    def log(self, what: str) -> None:
        print(f"[{self.now():6.1f} s] {what}", flush=True)

    # ---- the objects --------------------------------------------------------------------------------
    def isvc(self) -> dict[str, Any]:
        return self.emulator.objects[RESOURCE, NAMESPACE, NAME].raw

    def condition(self, kind: str) -> dict[str, Any]:
        conditions = (self.isvc().get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c.get("type") == kind), {})

    def live(self, plural: str) -> list[dict[str, Any]]:
        return [o.raw for (r, ns, _), o in list(self.emulator.objects.items())
                if r.plural == plural and ns == NAMESPACE and not o.deleted]

    def events(self) -> list[dict[str, Any]]:
        return self.live("events")

    def children(self) -> dict[str, int]:
        """Live children of the InferenceService, by kind (a duplicate or an orphan shows here)."""
        counts = {}
        for plural in ("deployments", "services", "poddisruptionbudgets", "persistentvolumeclaims"):
            counts[plural] = sum(1 for o in self.live(plural) for ref in o["metadata"].get("ownerReferences", [])
                                 if ref.get("name") == NAME)
        counts["pods"] = len(self.live("pods"))
        return counts

    # ---- the moving parts ---------------------------------------------------------------------------
    def start_operator(self) -> None:
        self.operator_starts += 1
        self.operator = start_operator(self.out, self.api_url, log_name=f"operator-{self.operator_starts}.log")

    def kill_operator(self) -> None:
        assert self.operator is not None
        self.operator.send_signal(signal.SIGKILL)
        self.operator.wait()

    async def patch_spec(self, spec: dict[str, Any]) -> None:
        resp = await self.emulator.patch(f"{CR_PATH}/{NAME}", json={"spec": spec},
                                         headers={"Content-Type": "application/merge-patch+json"})
        assert resp.status == 200, await resp.text()

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(KeyError):
                isvc = self.isvc()
                autoscaling = (isvc.get("status") or {}).get("autoscaling") or {}
                proposals = autoscaling.get("proposals") or {}
                degraded = self.condition("Degraded")
                self.samples.append(ClusterSample(
                    self.now(), int(isvc["spec"]["replicas"]), len(self.runner.ready_backends()),
                    int(self.condition("Ready").get("status") == "True"), int(degraded.get("status") == "True"),
                    degraded.get("reason", ""),
                    max((p["replicas"] for p in proposals.values() if "replicas" in p), default=None),
                    str(autoscaling.get("reason", "")),
                    int(self.operator is not None and self.operator.poll() is None), int(self.prometheus_up),
                    json.dumps(autoscaling.get("metrics") or {}, sort_keys=True)))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def wait_until(self, what: str, predicate: Any, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(KeyError, StopIteration):
                if predicate():
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s")
            await asyncio.sleep(0.1)
        self.log(what)
        return self.now()

    def between(self, lo: float, hi: float) -> list[ClusterSample]:
        return [s for s in self.samples if lo <= s.t <= hi]

    def plot(self, name: str, title: str, records: list[RequestRecord], lo: float, hi: float,
             marks: list[tuple[float, str]]) -> None:
        window = self.between(lo, hi)

        def series(field: str) -> list[tuple[float, float]]:
            return [(s.t, float(getattr(s, field))) for s in window if getattr(s, field) is not None]

        replicas = {"spec.replicas": series("spec_replicas"), "ready pods": series("ready_pods"),
                    "autoscaler proposal": series("proposal")}
        states = {"Ready": series("ready"), "Degraded": series("degraded"), "operator up": series("operator_up"),
                  "Prometheus up": series("prometheus_up")}
        plot_fault(self.out / f"{name}.png", title, [r for r in records if lo <= r.start <= hi], marks,
                   [("replicas", replicas), ("state (1 = True)", states)])


async def run_cluster_faults(model_dir: Path, out: Path, outage_s: float, down_window: int) -> dict[str, Any]:
    cluster = Cluster(model_dir, out)
    async with KubeEmulator() as emulator, kmock.Server(emulator, host="127.0.0.1") as server:
        cluster.emulator = emulator
        declare_builtin_resources(emulator)
        declare_crd(emulator, crd.crd())
        cluster.api_url = str(server.url).rstrip("/")
        await emulator.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                        "metadata": {"name": NAMESPACE}})
        prometheus = PrometheusServer(None, out / "prometheus", namespace=NAMESPACE).start()
        runner = cluster.runner = PodRunner(cluster.api_url, model_dir, out / "logs", warm_spares=True,
                                            on_change=prometheus.write_targets)
        front = RoundRobinFront(runner.ready_backends)
        await front.start()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(runner.run(stop)), asyncio.create_task(cluster.sampler(stop))]
        cluster.start_operator()
        load = Load(front.url, NAME, cluster.now, timeout_s=TIMEOUT_S)
        stop_load = asyncio.Event()
        results: dict[str, Any] = {}
        try:
            resp = await emulator.post(CR_PATH, json=inference_service(model_dir, prometheus.url, down_window))
            assert resp.status in (200, 201), await resp.text()
            await cluster.wait_until("2 replicas ready", lambda: len(runner.ready_backends()) == 2, 240)
            await cluster.wait_until("warm spare ready", runner.spares_ready, 240)
            users = asyncio.create_task(load.closed_loop(CLIENTS, stop_load, think_s=THINK_S))
            await asyncio.sleep(8)
            results["pod_kill"] = await pod_kill(cluster, load)
            results["operator_restart"] = await operator_restart(cluster, load)
            results["operator_scale_up"] = await operator_scale_up(cluster, load)
            results["prometheus_outage"] = await prometheus_outage(cluster, load, prometheus, stop_load, users,
                                                                   outage_s, down_window)
            results["events"] = [f"{e.get('type')} {e.get('reason')}: {e.get('message')}" for e in cluster.events()]
        finally:
            stop_load.set()
            with contextlib.suppress(KeyError):
                (out / "inferenceservice.json").write_text(json.dumps(cluster.isvc(), indent=1))
            (out / "timeline.json").write_text(json.dumps([asdict(s) for s in cluster.samples]))
            (out / "requests.json").write_text(json.dumps([r.row() for r in load.records]))
            stop.set()
            if cluster.operator is not None and cluster.operator.poll() is None:
                cluster.operator.terminate()
            await asyncio.gather(*tasks, return_exceptions=True)
            await load.close()
            await front.stop()
            if cluster.operator is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    cluster.operator.wait(10)
            prometheus.stop()
    return results


async def pod_kill(cluster: Cluster, load: Load) -> dict[str, Any]:
    runner = cluster.runner
    lo = cluster.now() - 5
    # Mid-stream: the pod to kill is one that is streaming tokens to a user right now, with at least
    # half of them still to come (a stream about to end may already be in the socket's buffers, and
    # then no request would fail).
    def streaming() -> RequestRecord | None:
        return next((r for r in load.records if r.ttft is not None and not r.end
                     and r.tokens <= load.max_tokens // 2 and r.backend in runner.ready_backends()), None)

    async def kill_a_streaming_pod() -> tuple[Replica, float]:
        while (record := streaming()) is None:
            await asyncio.sleep(0.02)
        # no await between finding the stream and the signal: it cannot end in between
        t_kill = cluster.now()
        return runner.kill(record.backend or ""), t_kill

    killed, t_kill = await asyncio.wait_for(kill_a_streaming_pod(), 30)
    killed_url = killed.url
    cluster.log(f"SIGKILL {killed.name} ({killed_url})")
    t_degraded = await cluster.wait_until("Degraded", lambda: cluster.condition("Degraded").get("status") == "True",
                                          30)
    degraded_reason = cluster.condition("Degraded").get("reason")
    t_ready = await cluster.wait_until(
        "Ready again", lambda: cluster.condition("Ready").get("status") == "True"
        and len(runner.ready_backends()) == 2, 120)
    await asyncio.sleep(4)
    hi = cluster.now()
    in_flight = [r for r in load.records if r.start < t_kill < (r.end or hi)]
    on_killed = [r for r in in_flight if r.backend == killed_url]
    window = [r for r in load.records if lo <= r.start and r.end and r.end <= hi]
    gone = cluster.between(t_kill, t_ready)
    result = {
        **outcome(window), "killed_pod": killed.name, "kill_at_s": round(t_kill, 2),
        "in_flight_at_kill": len(in_flight), "in_flight_on_killed_pod": len(on_killed),
        "degraded_after_s": round(t_degraded - t_kill, 2), "degraded_reason": degraded_reason,
        "recovery_s": round(t_ready - t_kill, 2),
        "lowest_proposal_while_gone": min((s.proposal for s in gone if s.proposal is not None), default=None),
        "lowest_spec_replicas_while_gone": min((s.spec_replicas for s in gone), default=None),
    }
    failed = [r for r in window if not r.ok]
    result["checks"] = {
        "pod-kill: failures only on the killed pod": bool(on_killed) and all(r.backend == killed_url for r in failed),
        "pod-kill: the killed pod's streams broke within 5 s (timeout 60 s)": all(
            r.end - t_kill < 5 for r in failed),
        "pod-kill: Degraded (ServerRestarted) while it was gone": degraded_reason == "ServerRestarted",
        "pod-kill: Ready again after its restart": t_ready > t_degraded,
        "pod-kill: no scale-down from the missing metrics": result["lowest_spec_replicas_while_gone"] == 2,
    }
    cluster.plot("pod-kill", f"SIGKILL of one of 2 serving pods under load ({CLIENTS} clients)", load.records,
                 lo, hi, [(t_kill, "SIGKILL"), (t_degraded, "Degraded"), (t_ready, "Ready")])
    return result


async def operator_restart(cluster: Cluster, load: Load) -> dict[str, Any]:
    lo = cluster.now()
    before = cluster.children()
    history = ((cluster.isvc().get("status") or {}).get("autoscaling") or {}).get("history")
    t_kill = cluster.now()
    cluster.kill_operator()
    cluster.log("operator SIGKILLed")
    await asyncio.sleep(3)
    t_start = cluster.now()
    cluster.start_operator()
    kv_at_restart = ((cluster.isvc().get("status") or {}).get("kvCache") or {}).get("updatedAt")
    t_status = await cluster.wait_until(
        "status written by the new operator",
        lambda: ((cluster.isvc().get("status") or {}).get("kvCache") or {}).get("updatedAt") != kv_at_restart, 60)
    await asyncio.sleep(4)
    hi = cluster.now()
    window = [r for r in load.records if lo <= r.start and r.end and r.end <= hi]
    samples = cluster.between(lo, hi)
    result = {**outcome(window), "operator_down_s": round(t_start - t_kill, 2),
              "status_resumed_after_start_s": round(t_status - t_start, 2),
              "children_before": before, "children_after": cluster.children(),
              "spec_replicas_seen": sorted({s.spec_replicas for s in samples})}
    result["checks"] = {
        "operator-restart: no request failed": result["failed"] == 0,
        "operator-restart: no duplicate or orphaned children": result["children_after"] == before,
        "operator-restart: spec.replicas held": result["spec_replicas_seen"] == [2],
        "operator-restart: status and history continue": bool(history) and t_status > t_start,
    }
    cluster.plot("operator-restart", "The operator SIGKILLed and restarted under load", load.records, lo, hi,
                 [(t_kill, "operator SIGKILL"), (t_start, "operator started"), (t_status, "status resumes")])
    return result


async def operator_scale_up(cluster: Cluster, load: Load) -> dict[str, Any]:
    await cluster.wait_until("warm spare ready", cluster.runner.spares_ready, 120)
    lo = cluster.now()
    scaled_before = sum(e.get("reason") == "ScaledUp" for e in cluster.events())
    await cluster.patch_spec({"autoscaling": {"maxReplicas": 3}})
    t_scaled = await cluster.wait_until("the autoscaler wrote spec.replicas = 3",
                                        lambda: cluster.isvc()["spec"]["replicas"] == 3, 60)
    deployment_at_kill = cluster.live("deployments")[0]["spec"]["replicas"]
    cluster.kill_operator()
    cluster.log(f"operator SIGKILLed (Deployment replicas then: {deployment_at_kill})")
    await asyncio.sleep(3)
    t_start = cluster.now()
    cluster.start_operator()
    t_done = await cluster.wait_until(
        "3 replicas ready", lambda: len(cluster.runner.ready_backends()) == 3
        and cluster.condition("Ready").get("status") == "True", 180)
    await asyncio.sleep(3)
    hi = cluster.now()
    samples = cluster.between(t_scaled, hi)
    changes = [s.spec_replicas for a, s in itertools.pairwise(samples) if s.spec_replicas != a.spec_replicas]
    window = [r for r in load.records if lo <= r.start and r.end and r.end <= hi]
    result = {**outcome(window), "deployment_replicas_at_kill": deployment_at_kill,
              "scale_up_done_after_s": round(t_done - t_scaled, 2),
              "spec_replicas_changes_after_scale_up": changes, "children_after": cluster.children(),
              "scaled_up_events": sum(e.get("reason") == "ScaledUp" for e in cluster.events()) - scaled_before}
    result["checks"] = {
        "operator-scale-up: the scale-up completed (3 ready)": t_done > t_start,
        "operator-scale-up: no flapping (spec.replicas stayed 3)": changes == [],
        # The Event is posted after spec.replicas is written: a kill in between loses it, never doubles it.
        "operator-scale-up: no duplicate ScaledUp Event": result["scaled_up_events"] <= 1,
        "operator-scale-up: one Deployment, 3 pods": result["children_after"]["deployments"] == 1
        and result["children_after"]["pods"] == 3,
        "operator-scale-up: no request failed": result["failed"] == 0,
    }
    cluster.plot("operator-scale-up", "The operator SIGKILLed in the middle of a scale-up 2 → 3", load.records,
                 lo, hi, [(t_scaled, "spec.replicas = 3, operator SIGKILL"), (t_start, "operator started"),
                          (t_done, "3 ready")])
    return result


async def prometheus_outage(cluster: Cluster, load: Load, prometheus: Any, stop_load: asyncio.Event,
                            users: asyncio.Task, outage_s: float, down_window: int) -> dict[str, Any]:
    lo = cluster.now()
    stop_load.set()  # idle from now on: a scale-down on missing data would show within the outage
    await users
    held = cluster.isvc()["spec"]["replicas"]
    t_down = cluster.now()
    prometheus.stop()
    cluster.prometheus_up = False
    cluster.log(f"Prometheus stopped for {outage_s:.0f} s")
    t_event = await cluster.wait_until("MetricsUnavailable Event", lambda: any(
        e.get("reason") == "MetricsUnavailable" for e in cluster.events()), 30)
    status_reason = ((cluster.isvc().get("status") or {}).get("autoscaling") or {}).get("reason", "")
    await asyncio.sleep(max(0.0, t_down + outage_s - cluster.now()))
    during = cluster.between(t_down, cluster.now())
    prometheus.start()  # it starts with an empty target list: give it the current pods again
    prometheus.write_targets(cluster.runner.ready_pods())
    cluster.prometheus_up = True
    t_up = cluster.now()
    cluster.log("Prometheus started again")
    t_resumed = await cluster.wait_until("scaled down after the outage",
                                         lambda: cluster.isvc()["spec"]["replicas"] < held, down_window + 60)
    await asyncio.sleep(2)
    hi = cluster.now()
    events = [e for e in cluster.events() if e.get("reason") in ("MetricsUnavailable", "MetricsAvailable")]
    result = {"outage_s": round(t_up - t_down, 1), "replicas_held": held,
              "spec_replicas_during_outage": sorted({s.spec_replicas for s in during}),
              "event_after_s": round(t_event - t_down, 2), "status_reason_during_outage": status_reason,
              "scaled_down_after_return_s": round(t_resumed - t_up, 2),
              "replicas_after": cluster.isvc()["spec"]["replicas"],
              "events": [f"{e.get('type')} {e.get('reason')}: {e.get('message')}" for e in events]}
    result["checks"] = {
        "prometheus-outage: replicas held for the whole outage": result["spec_replicas_during_outage"] == [held],
        "prometheus-outage: the outage outlasted the scale-down window": outage_s > down_window,
        "prometheus-outage: a Warning Event says why": any(e.get("type") == "Warning" for e in events),
        "prometheus-outage: status says why": "metrics source unavailable" in status_reason,
        "prometheus-outage: scaling resumed once it was back": t_resumed > t_up,
        "prometheus-outage: a Normal Event when it was back": any(
            e.get("reason") == "MetricsAvailable" for e in events),
    }
    cluster.plot("prometheus-outage", f"Prometheus down for {outage_s:.0f} s (load stopped at its start)",
                 load.records, lo, hi, [(t_down, "Prometheus down"), (t_event, "Warning Event"),
                                        (t_up, "Prometheus up"), (t_resumed, "scaled down")])
    return result
