"""The local end-to-end run: the real operator scaling real serving processes, on one machine.

    python e2e/local.py [--out e2e/out] [--prometheus]

Stand-ins for a cluster (see e2e/README.md): kmock's Kubernetes emulator (tests/support/kube_emulator.py)
serves the API on loopback; the real `pagoda operator` runs as a process against it (a kubeconfig);
e2e/pod_runner.py plays Deployment controller + kubelet with real `pagoda serve` processes (a tiny
random model); e2e/front.py is the Service; `pagoda bench serve` is the load. Optionally a real
Prometheus scrapes the servers (file-based discovery) and the autoscaler reads from it.

Scenario: one server whose KV cache saturates under the load → the autoscaler adds a replica → the new
replica takes traffic and p99 TTFT falls → the load stops → after the (shortened) scale-down window
it returns to one replica. No request may fail. Prints a timeline and writes timeline.png/json and
summary.json under --out; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
# The emulator and the tiny model builder live with the tests; `e2e` is a folder of the repo, not of
# the installed package. The repo root goes last: its `operator/` and `kernels/` folders must not
# shadow the stdlib's `operator` or the `kernels` package that transformers imports (why scripts run
# with PYTHONSAFEPATH).
sys.path.insert(0, str(REPO / "tests"))
sys.path.append(str(REPO))

import kmock  # noqa: E402
from pagoda.operator import crd  # noqa: E402
from pagoda.operator.autoscaling.collect import MetricsError, parse_metrics  # noqa: E402
from support.kube_emulator import KubeEmulator, declare_builtin_resources, declare_crd  # noqa: E402
from support.prometheus import PrometheusServer, free_port  # noqa: E402

from e2e.front import RoundRobinFront  # noqa: E402
from e2e.pod_runner import PodRunner  # noqa: E402
from e2e.timeline import Sample, attach_ttft, p99, plot, table  # noqa: E402

NAMESPACE, NAME = "default", "tiny"
CR_PATH = f"/apis/{crd.API_VERSION}/namespaces/{NAMESPACE}/{crd.PLURAL}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python e2e/local.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "e2e" / "out", help="where logs, plot and results go")
    p.add_argument("--num-blocks", type=int, default=16,
                   help="KV blocks per server (16 tokens each): 16 hold one request of the default size")
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--interval", type=int, default=2, help="autoscaler intervalSeconds")
    p.add_argument("--down-window", type=int, default=20, help="scaleDownStabilizationSeconds")
    p.add_argument("--load-seconds", type=float, default=45.0)
    p.add_argument("--clients", type=int, default=8,
                   help="concurrent clients (closed loop): one server's KV cache holds one request, so "
                   "one server queues clients-1 of them")
    # Long prompts, short answers: much KV per request for few (CPU-bound) decode steps.
    p.add_argument("--input-len", type=int, default=160)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--cold-starts", action="store_true",
                   help="no warm spare server: new pods start from scratch (slow on a busy machine)")
    p.add_argument("--prometheus", action="store_true",
                   help="run a real Prometheus and let the autoscaler read from it (prometheusURL)")
    return p.parse_args(argv)


def inference_service(args: argparse.Namespace, model_dir: Path, prometheus_url: str | None) -> dict[str, Any]:
    autoscaling: dict[str, Any] = {
        "enabled": False,  # switched on after the calibration burst
        "minReplicas": 1, "maxReplicas": args.max_replicas, "targetKVCacheUsage": 0.7,
        "targetQueueDepth": 4, "intervalSeconds": args.interval, "scrapeTimeoutSeconds": 1,
        "scaleDownStabilizationSeconds": args.down_window}
    if prometheus_url:
        autoscaling["prometheusURL"] = prometheus_url
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"model": {"uri": f"file://{model_dir}", "servedName": NAME}, "replicas": 1,
                     "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
                     "engine": {"dtype": "float32", "maxNumSeqs": 16,
                                "extraArgs": ["--num-blocks", str(args.num_blocks), "--drain-timeout", "30"]},
                     "drainTimeoutSeconds": 30, "autoscaling": autoscaling,
                     "monitoring": {"serviceMonitor": False}}}


def write_kubeconfig(path: Path, server: str) -> Path:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "e2e",
              "clusters": [{"name": "e2e", "cluster": {"server": server}}],
              "users": [{"name": "e2e", "user": {"token": "e2e"}}],
              "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e", "namespace": NAMESPACE}}]}
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def build_model(out: Path) -> Path:
    """A small random Llama (~20M parameters): heavy enough that the servers, not this harness's
    proxying, limit the throughput (so a second replica shows in TTFT), light enough to keep up on
    two busy cores."""
    from support.tiny_models import make_tiny_model

    target = out / "llama-512x8"
    if not (target / "config.json").exists():
        make_tiny_model("llama", target, hidden=512, num_layers=8)
    return target


async def scrape(session: aiohttp.ClientSession, backends: list[str]) -> tuple[float | None, float | None]:
    """Mean KV usage and total waiting over the ready servers, read by the harness itself."""
    samples = []
    for url in backends:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, MetricsError):
            async with session.get(f"{url}/metrics") as response:
                samples.append(parse_metrics(await response.text()))
    if not samples:
        return None, None
    return sum(s.kv_cache_usage for s in samples) / len(samples), sum(s.waiting for s in samples)


class Scenario:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.samples: list[Sample] = []
        self.phase = "idle"
        self.t0 = time.monotonic()
        self.model_dir = Path()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def sampler(self, emulator: KubeEmulator, runner: PodRunner, stop: asyncio.Event) -> None:
        resource = f"{crd.API_VERSION}/{crd.PLURAL}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
            while not stop.is_set():
                with contextlib.suppress(KeyError):
                    isvc = emulator.objects[resource, NAMESPACE, NAME].raw
                    proposals = ((isvc.get("status") or {}).get("autoscaling") or {}).get("proposals") or {}
                    recommended = max((p.get("replicas", 0) for p in proposals.values()), default=None)
                    kv, waiting = await scrape(session, runner.ready_backends())
                    self.samples.append(Sample(round(self.now(), 1), self.phase, int(isvc["spec"]["replicas"]),
                                               len(runner.ready_backends()), kv, waiting, recommended))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    def desired(self) -> int:
        return self.samples[-1].desired if self.samples else 0

    async def wait_until(self, what: str, predicate: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s")
            await asyncio.sleep(0.5)
        print(f"[{self.now():6.1f} s] {what}", flush=True)

    async def run(self) -> dict[str, Any]:
        # SIGTERM (a CI timeout, `kill`) cancels the scenario, so the finally-blocks stop every process.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
        args, out = self.args, self.out
        out.mkdir(parents=True, exist_ok=True)
        model_dir = self.model_dir = build_model(out)
        async with KubeEmulator() as emulator, kmock.Server(emulator, host="127.0.0.1") as server:
            declare_builtin_resources(emulator)
            declare_crd(emulator, crd.crd())
            api_url = str(server.url).rstrip("/")
            await emulator.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                            "metadata": {"name": NAMESPACE}})
            prometheus = start_prometheus(out) if args.prometheus else None
            runner = PodRunner(api_url, model_dir, out / "logs", warm_spares=not args.cold_starts,
                               on_change=prometheus.write_targets if prometheus else None)
            front = RoundRobinFront(runner.ready_backends)
            await front.start()
            stop = asyncio.Event()
            tasks = [asyncio.create_task(runner.run(stop)),
                     asyncio.create_task(self.sampler(emulator, runner, stop))]
            operator = start_operator(out, api_url)
            try:
                resp = await emulator.post(CR_PATH, json=inference_service(
                    args, model_dir, prometheus.url if prometheus else None))
                assert resp.status in (200, 201), await resp.text()
                await self.wait_until("1 replica ready", lambda: len(runner.ready_backends()) == 1, 180)
                await self.wait_until("warm spare ready", runner.spares_ready, 180)
                capacity = await self.calibrate(front)
                resp = await emulator.patch(f"{CR_PATH}/{NAME}", json={"spec": {"autoscaling": {"enabled": True}}},
                                            headers={"Content-Type": "application/merge-patch+json"})
                assert resp.status == 200, await resp.text()
                await asyncio.sleep(2 * args.interval)
                result = await self.load_and_cool_down(front, runner, capacity)
                result["scale_events"] = [
                    f"{o.raw.get('reason')}: {o.raw.get('message')}" for (r, _, _), o in emulator.objects.items()
                    if r.plural == "events" and str(o.raw.get("reason", "")).startswith("Scaled")]
                result["checks"]["an Event per scale"] = (
                    [e.split(":")[0] for e in result["scale_events"]] == ["ScaledUp", "ScaledDown"])
            finally:
                with contextlib.suppress(KeyError):  # the final InferenceService and Events, for the record
                    (out / "inferenceservice.json").write_text(json.dumps(
                        emulator.objects[f"{crd.API_VERSION}/{crd.PLURAL}", NAMESPACE, NAME].raw, indent=1))
                (out / "events.json").write_text(json.dumps(
                    [o.raw for (r, _, _), o in emulator.objects.items() if r.plural == "events"], indent=1))
                stop.set()
                operator.terminate()
                await asyncio.gather(*tasks, return_exceptions=True)
                await front.stop()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    operator.wait(10)
                if prometheus:
                    prometheus.stop()
        return result

    async def bench(self, front: RoundRobinFront, name: str, num_prompts: int, clients: int) -> dict[str, Any]:
        """`pagoda bench serve` through the front; its saved result (the last run) and exit code."""
        bench = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pagoda.cli", "bench", "serve", "--base-url", front.url, "--model", NAME,
            "--num-prompts", str(num_prompts), "--max-concurrency", str(clients),
            "--input-len", str(self.args.input_len), "--output-len", str(self.args.output_len), "--seed", "1",
            "--tokenizer", str(self.model_dir),  # exact prompt lengths in the served model's tokens
            "--save-result", str(self.out / f"{name}.json"), "--no-progress",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=self.out)
        output, _ = await bench.communicate()
        (self.out / f"{name}.txt").write_bytes(output)
        saved = json.loads((self.out / f"{name}.json").read_text())
        run = saved["runs"][-1] if "runs" in saved else saved
        return {**run, "exit_code": bench.returncode}

    async def calibrate(self, front: RoundRobinFront) -> float:
        """One server's throughput (req/s) with autoscaling still off: it sizes the load's request count
        so the load lasts about --load-seconds on a slow or a fast machine."""
        self.phase = "calibrate"
        result = await self.bench(front, "calibration", num_prompts=24, clients=self.args.clients)
        capacity = result["summary"]["request_throughput"]
        if result["summary"]["failed_requests"] or not capacity:
            raise RuntimeError(f"calibration failed: see {self.out / 'calibration.txt'}")
        print(f"[{self.now():6.1f} s] one server: {capacity:.2f} req/s with {self.args.clients} clients",
              flush=True)
        self.phase = "idle"
        return capacity

    async def load_and_cool_down(self, front: RoundRobinFront, runner: PodRunner,
                                 capacity: float) -> dict[str, Any]:
        args = self.args
        self.phase = "load"
        front.first_post_at = None  # align with this bench run
        front.requests_per_backend.clear()  # count the load's requests only
        load_started = self.now()
        # Sized for ~1.5 servers' worth of throughput over --load-seconds.
        num_prompts = max(40, int(1.5 * capacity * args.load_seconds))
        result = await self.bench(front, "bench", num_prompts=num_prompts, clients=args.clients)
        self.phase = "cooldown"
        load_ended = self.now()
        print(f"[{load_ended:6.1f} s] load finished (bench exit {result['exit_code']})", flush=True)
        await self.wait_until("back to minReplicas", lambda: self.desired() == 1 and
                              len(runner.ready_backends()) == 1, args.down_window + 90)
        scaled_down_at = self.now()
        await asyncio.sleep(2)

        requests = result["requests"]
        bench_t0 = (front.first_post_at or 0.0) - self.t0
        attach_ttft(self.samples, requests, bench_t0)
        summary = self.summarize(requests, bench_t0, load_started, load_ended, scaled_down_at, front,
                                 result["exit_code"])
        return {"clients": args.clients, "one_server_req_per_s": round(capacity, 2), **summary}

    def summarize(self, requests: list[dict[str, Any]], bench_t0: float, load_started: float,
                  load_ended: float, scaled_down_at: float, front: RoundRobinFront,
                  bench_rc: int | None) -> dict[str, Any]:
        def ttfts(lo: float, hi: float) -> list[float]:
            return [r["ttft"] for r in requests if r.get("success") and lo <= bench_t0 + r["start"] < hi]

        first_scale_up = next((s.t for s in self.samples if s.desired >= 2), None)
        second_ready = next((s.t for s in self.samples if s.ready >= 2), None)
        # Before the second replica took traffic vs the last third of the load.
        early = ttfts(bench_t0, second_ready if second_ready else load_ended)
        last_start = max((r["start"] for r in requests), default=0.0)
        late = ttfts(bench_t0 + 2 * last_start / 3, load_ended)  # the last third of the arrivals
        max_desired = max(s.desired for s in self.samples)
        # The last moment the autoscaler still recommended more than one replica (from its status).
        last_high = max((s.t for s in self.samples if s.t < scaled_down_at and (s.recommended or 0) >= 2),
                        default=None)
        summary = {
            "requests": len(requests), "failed": sum(not r.get("success") for r in requests),
            "front_failures": front.failures, "bench_exit_code": bench_rc,
            "requests_per_backend": dict(front.requests_per_backend),
            "max_desired_replicas": max_desired, "first_scale_up_s": first_scale_up,
            "second_replica_ready_s": second_ready, "load_s": [round(load_started, 1), round(load_ended, 1)],
            "back_to_min_s": round(scaled_down_at, 1),
            "back_to_min_after_load_s": round(scaled_down_at - load_ended, 1),
            "back_to_min_after_last_high_recommendation_s":
                round(scaled_down_at - last_high, 1) if last_high is not None else None,
            "p99_ttft_one_replica_s": p99(early), "p99_ttft_last_third_s": p99(late),
        }
        checks = {
            "scaled to >= 2 replicas": max_desired >= 2,
            "new replica received traffic": len(front.requests_per_backend) >= 2
            and min(front.requests_per_backend.values()) > 0,
            "p99 TTFT fell": bool(early and late) and (p99(late) or 0) < (p99(early) or 0),
            "no request failed": summary["failed"] == 0 and front.failures == 0 and bench_rc == 0,
            # Scale-down waits for the window after the last recommendation above 1 (± a sampling period).
            "back to minReplicas after the window": last_high is not None
            and self.args.down_window - 2 * self.args.interval <= scaled_down_at - last_high
            <= self.args.down_window + 4 * self.args.interval,
            "no scale-down during the load": all(
                b.desired >= a.desired for a, b in zip(self.samples, self.samples[1:], strict=False)
                if b.phase == "load"),
        }
        summary["checks"] = checks
        return summary


def start_operator(out: Path, api_url: str, log_name: str = "operator.log") -> subprocess.Popen:
    env = {**os.environ, "KUBECONFIG": str(write_kubeconfig(out / "kubeconfig.yaml", api_url)),
           "PAGODA_SERVER_IMAGE": "local/pagoda-server:e2e"}
    log = open(out / log_name, "wb")  # noqa: SIM115 - owned by the process
    process = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "operator", "--all-namespaces", "--standalone",
                                "--health-port", str(free_port()), "--metrics-port", str(free_port()),
                                "--status-interval", "2", "--verbose"], env=env, stdout=log, stderr=subprocess.STDOUT,
                               cwd=out)  # not the repo root: its `operator/` folder would shadow the stdlib
    log.close()
    return process


def start_prometheus(out: Path) -> Any:
    return PrometheusServer(None, out / "prometheus", namespace=NAMESPACE).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scenario = Scenario(args)
    summary = asyncio.run(scenario.run())
    out: Path = args.out
    (out / "timeline.json").write_text(json.dumps([s.row() for s in scenario.samples], indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(scenario.samples, out / "timeline.png",
         f"KV-cache autoscaling, local e2e: {summary['requests']} requests, "
         f"max {summary['max_desired_replicas']} replicas")
    print(table(scenario.samples, every=max(1, len(scenario.samples) // 60)))
    print(json.dumps({k: v for k, v in summary.items() if k != "checks"}, indent=1))
    for check, ok in summary["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    print(f"plot: {out / 'timeline.png'}")
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
