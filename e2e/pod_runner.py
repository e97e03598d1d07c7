"""The stand-in for the Deployment controller + kubelet: real `pagoda serve` processes on loopback.

Every `poll_s` it lists Deployments in the emulated API server and makes the number of serving
processes match each one's `spec.replicas`:
- start: the pod template's container command/args and `PAGODA_*` env (as a kubelet would), with
  `--host 127.0.0.1 --port <free port>` and `PAGODA_MODEL` pointed at a local model folder; a Pod
  object is created with the template's labels, `podIP: 127.0.0.1` and the port in the annotation
  `serving.pagoda.dev/metrics-port` (every "pod" shares one IP here, so the port tells them apart);
- readiness: `GET /ready` of each process becomes the Pod's Ready condition and the server
  container's `ready` in `containerStatuses`;
- restarts: a process that exits is restarted in the same Pod (restartPolicy: Always; a cold
  start), with `restartCount` + 1 and `lastState.terminated` (exit code, reason) as a kubelet
  reports them;
- stop (newest first): first out of the front's rotation and the Pod object deleted (as endpoints
  drop a terminating pod), then SIGTERM so the server drains its in-flight requests;
- status: the Deployment's `status.replicas/readyReplicas/...` as the controller reports them;
- warm spares (optional): one extra server per Deployment started ahead and handed to the next new
  pod, as pre-pulled images and page-cached weights make a node's pod start fast; without it a new
  pod here spends its first ~10-30 s importing torch on a busy CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pagoda.operator.autoscaling.collect import METRICS_PORT_ANNOTATION
from pagoda.operator.render import SERVER_CONTAINER
from support.prometheus import free_port  # tests/ is on sys.path (e2e/local.py)

MERGE = {"Content-Type": "application/merge-patch+json"}
READINESS_FAILURE_THRESHOLD = 3


@dataclass
class Replica:
    name: str
    port: int
    process: subprocess.Popen
    ready: bool = False
    routable: bool = True  # False once it is being stopped: the front sends it nothing new
    restart_count: int = 0
    failed_probes: int = 0  # consecutive failed /ready probes
    last_exit: int | None = None  # the exit code of the previous process, after a restart

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Spare:
    """A server process started ahead for the next pod; `key` is the command and env it runs."""

    port: int
    process: subprocess.Popen
    key: str
    ready: bool = False


@dataclass
class Workload:
    namespace: str
    name: str
    replicas: list[Replica] = field(default_factory=list)
    spare: Spare | None = None


def serve_command(container: dict[str, Any], port: int) -> list[str]:
    """The container's `pagoda serve ...` as a local command, listening on 127.0.0.1:port."""
    args = [*container.get("command", []), *container.get("args", [])]
    if args[:1] == ["pagoda"]:
        args = [sys.executable, "-m", "pagoda.cli", *args[1:]]
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("--host", "--port"):
            skip = True
            continue
        out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def serve_env(container: dict[str, Any], model_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e})
    env["PAGODA_MODEL"] = str(model_dir)  # the container's path lives on a PVC we do not have
    # Several servers share this machine's few cores: one thread each, as a CPU limit of 1 would.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TORCH_NUM_THREADS="1")
    return env


class PodRunner:
    def __init__(self, api_url: str, model_dir: Path, log_dir: Path, poll_s: float = 0.5,
                 on_change: Callable[[dict[str, str]], None] | None = None, warm_spares: bool = False) -> None:
        """`on_change({pod name: "127.0.0.1:port"})` is called whenever the set of ready pods changes."""
        self.api_url = api_url.rstrip("/")
        self.on_change = on_change
        self.warm_spares = warm_spares
        self._processes = 0
        self._last_ready: dict[str, str] = {}
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.poll_s = poll_s
        self.workloads: dict[tuple[str, str], Workload] = {}
        self._stopping: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None

    def ready_backends(self) -> list[str]:
        return [r.url for w in self.workloads.values() for r in w.replicas if r.ready and r.routable]

    def ready_pods(self) -> dict[str, str]:
        """{pod name: "127.0.0.1:port"} of the ready pods (what Prometheus discovery should see)."""
        return {r.name: f"127.0.0.1:{r.port}" for w in self.workloads.values() for r in w.replicas if r.ready}

    def _notify(self) -> None:
        ready = self.ready_pods()
        if ready != self._last_ready and self.on_change:
            self.on_change(ready)
        self._last_ready = ready

    async def run(self, stop: asyncio.Event) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as self._session:
            try:
                while not stop.is_set():
                    await self.sync_once()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.poll_s)
            finally:
                for workload in self.workloads.values():
                    for replica in list(workload.replicas):
                        await self._stop_replica(workload, replica)
                    self._drop_spare(workload)
                await asyncio.gather(*self._stopping, return_exceptions=True)

    async def _api(self, method: str, path: str, **kwargs: Any) -> Any:
        assert self._session is not None
        async with self._session.request(method, self.api_url + path, **kwargs) as response:
            if response.status >= 400:
                raise RuntimeError(f"{method} {path}: {response.status} {await response.text()}")
            return await response.json()

    async def sync_once(self) -> None:
        deployments = (await self._api("GET", "/apis/apps/v1/deployments"))["items"]
        seen = set()
        for deployment in deployments:
            meta = deployment["metadata"]
            key = (meta["namespace"], meta["name"])
            seen.add(key)
            workload = self.workloads.setdefault(key, Workload(*key))
            await self._reconcile(workload, deployment)
        for key in set(self.workloads) - seen:  # Deployment deleted
            workload = self.workloads.pop(key)
            for replica in list(workload.replicas):
                await self._stop_replica(workload, replica)
            self._drop_spare(workload)
        self._notify()

    async def _reconcile(self, workload: Workload, deployment: dict[str, Any]) -> None:
        desired = int(deployment["spec"].get("replicas", 1))
        for replica in workload.replicas:
            if (code := replica.process.poll()) is not None:  # the container exited: restart it in place
                await self._restart_container(workload, replica, deployment, code)
        while len(workload.replicas) < desired:
            await self._start_replica(workload, deployment)
        while len(workload.replicas) > desired:
            await self._stop_replica(workload, workload.replicas[-1])
        for replica in workload.replicas:
            await self._refresh_readiness(workload, replica)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        if self.warm_spares and workload.replicas and workload.spare is None:
            port, process = self._start_process(container)
            workload.spare = Spare(port, process, self._key(container))
        if workload.spare is not None and not workload.spare.ready:
            workload.spare.ready = await self._answers_ready(workload.spare.port)
        ready = sum(r.ready for r in workload.replicas)
        await self._api("PATCH", f"/apis/apps/v1/namespaces/{workload.namespace}/deployments/{workload.name}/status",
                        json={"status": {"replicas": len(workload.replicas), "readyReplicas": ready,
                                         "availableReplicas": ready, "updatedReplicas": len(workload.replicas),
                                         "observedGeneration": deployment["metadata"].get("generation", 1)}},
                        headers=MERGE)

    def _key(self, container: dict[str, Any]) -> str:
        return repr((serve_command(container, 0), sorted(serve_env(container, self.model_dir).items())))

    def _start_process(self, container: dict[str, Any]) -> tuple[int, subprocess.Popen]:
        port = free_port()
        self._processes += 1
        log = open(self.log_dir / f"serve-{self._processes}-port-{port}.log", "wb")  # noqa: SIM115 - the process's
        process = subprocess.Popen(serve_command(container, port), env=serve_env(container, self.model_dir),
                                   stdout=log, stderr=subprocess.STDOUT, cwd=self.log_dir)
        log.close()
        return port, process

    @staticmethod
    def _drop_spare(workload: Workload) -> None:
        if workload.spare is not None:
            workload.spare.process.kill()
            workload.spare.process.wait()
            workload.spare = None

    async def _start_replica(self, workload: Workload, deployment: dict[str, Any]) -> None:
        template = deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        name = f"{workload.name}-{uuid.uuid4().hex[:5]}"
        spare = workload.spare
        if spare is not None and spare.key == self._key(container) and spare.process.poll() is None:
            port, process = spare.port, spare.process
            workload.spare = None  # the next round starts another one
        else:
            self._drop_spare(workload)  # the template changed (or it died): it would run the old pod
            port, process = self._start_process(container)
        workload.replicas.append(Replica(name, port, process))
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": workload.namespace,
                            "labels": dict(template["metadata"].get("labels", {})),
                            "annotations": {METRICS_PORT_ANNOTATION: str(port)}},
               "spec": template["spec"],
               "status": {"phase": "Running", "podIP": "127.0.0.1",
                          "conditions": [{"type": "Ready", "status": "False"}]}}
        await self._api("POST", f"/api/v1/namespaces/{workload.namespace}/pods", json=pod)

    async def _restart_container(self, workload: Workload, replica: Replica, deployment: dict[str, Any],
                                 code: int) -> None:
        # A cold start, never the warm spare: a restarted container loads its model again, and the
        # time it is gone is what the fault costs.
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        replica.port, replica.process = self._start_process(container)
        replica.restart_count += 1
        replica.last_exit = code
        replica.ready, replica.failed_probes = False, 0
        await self._api("PATCH", f"/api/v1/namespaces/{workload.namespace}/pods/{replica.name}",
                        json={"metadata": {"annotations": {METRICS_PORT_ANNOTATION: str(replica.port)}}},
                        headers=MERGE)
        await self._patch_pod_status(workload, replica)

    def kill(self, url: str, sig: int = signal.SIGKILL) -> Replica:
        """Send `sig` to the serving process at `url` (the fault a lost node or an OOM kill is to a pod)."""
        replica = next(r for w in self.workloads.values() for r in w.replicas if r.url == url)
        replica.process.send_signal(sig)
        return replica

    def spares_ready(self) -> bool:
        return all(w.spare is None or w.spare.ready for w in self.workloads.values())

    async def _answers_ready(self, port: int) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"http://127.0.0.1:{port}/ready",
                                         timeout=aiohttp.ClientTimeout(total=1)) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _refresh_readiness(self, workload: Workload, replica: Replica) -> None:
        # As the kubelet's readinessProbe (failureThreshold 3, as rendered): one slow answer from a
        # busy server does not take it out of the endpoints.
        answered = await self._answers_ready(replica.port)
        replica.failed_probes = 0 if answered else replica.failed_probes + 1
        ready = answered or (replica.ready and replica.failed_probes < READINESS_FAILURE_THRESHOLD)
        if ready != replica.ready:
            replica.ready = ready
            await self._patch_pod_status(workload, replica)

    async def _patch_pod_status(self, workload: Workload, replica: Replica) -> None:
        server: dict[str, Any] = {"name": SERVER_CONTAINER, "ready": replica.ready,
                                  "restartCount": replica.restart_count, "state": {"running": {}}}
        if replica.last_exit is not None:
            # A kubelet names a signal death by its exit code 128 + n; -9 from Popen is SIGKILL.
            code = 128 - replica.last_exit if replica.last_exit < 0 else replica.last_exit
            server["lastState"] = {"terminated": {"exitCode": code, "reason": "Error"}}
        condition = {"type": "Ready", "status": "True" if replica.ready else "False"}
        await self._api("PATCH", f"/api/v1/namespaces/{workload.namespace}/pods/{replica.name}/status",
                        json={"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [condition],
                                         "containerStatuses": [server]}},
                        headers=MERGE)

    async def _stop_replica(self, workload: Workload, replica: Replica) -> None:
        replica.routable = False
        workload.replicas.remove(replica)
        with contextlib.suppress(RuntimeError):  # already gone
            await self._api("DELETE", f"/api/v1/namespaces/{workload.namespace}/pods/{replica.name}")
        task = asyncio.create_task(self._terminate(replica))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    @staticmethod
    async def _terminate(replica: Replica, grace_s: float = 40.0) -> None:
        """SIGTERM (the server drains in-flight requests), SIGKILL after the grace period."""
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)
        for _ in range(int(grace_s * 10)):
            if replica.process.poll() is not None:
                return
            await asyncio.sleep(0.1)
        replica.process.kill()
