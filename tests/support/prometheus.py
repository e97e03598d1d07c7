"""A real Prometheus (Debian's `prometheus` binary) for tests: scrape given targets, answer PromQL.

    with PrometheusServer(["127.0.0.1:8000"], tmp_path) as prom:
        prom.wait_for("pagoda_num_requests_running")      # polls until the query returns data
        prom.query('sum(pagoda_generation_tokens_total)')  # -> list of {"metric": {...}, "value": [t, "v"]}

Listens on a free loopback port, scrapes every `scrape_interval` seconds, keeps its TSDB in `workdir`.
Tests that need it should skip when the binary is missing (`prometheus_binary() is None`).

With `namespace=` instead of fixed targets it finds them by file-based discovery: `write_targets({pod:
"host:port"})` rewrites the list as pods come and go (the local e2e's pod runner does), each target with
the `namespace` and `pod` labels Kubernetes discovery would attach, so the autoscaler's queries work
unchanged. This module is also where tests, e2e and benchmarks get a free port.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

# The one free_port (tests, e2e and benchmarks get it here): the product's, which picks the rendezvous port.
from pagoda.server.engine.parallel.launch import free_port

__all__ = ["PrometheusServer", "free_port", "prometheus_binary"]


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    def __init__(
        self,
        targets: list[str] | None,
        workdir: Path,
        *,
        scrape_interval: float = 1.0,
        job: str = "pagoda",
        metrics_path: str = "/metrics",
        namespace: str | None = None,
    ) -> None:
        if (targets is None) == (namespace is None):
            raise ValueError("give fixed targets or a namespace for file-based discovery, not both")
        self.targets = targets
        self.namespace = namespace
        self.targets_file = Path(workdir) / "targets.json"
        self.workdir = Path(workdir)
        self.scrape_interval = scrape_interval
        self.job = job
        self.metrics_path = metrics_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def _write_config(self) -> Path:
        interval = f"{int(self.scrape_interval * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {
                    "job_name": self.job,
                    "metrics_path": self.metrics_path,
                    "scrape_interval": interval,
                    "scrape_timeout": interval,
                    **(
                        {"static_configs": [{"targets": self.targets}]}
                        if self.targets is not None
                        else {"file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}]}
                    ),
                }
            ],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    def write_targets(self, pods: dict[str, str]) -> None:
        """File-based discovery: scrape these pods ({name: "host:port"}) from now on."""
        groups = [{"targets": [target], "labels": {"namespace": self.namespace, "pod": name}}
                  for name, target in pods.items()]  # fmt: skip
        scratch = self.targets_file.with_suffix(".tmp")
        scratch.write_text(json.dumps(groups))
        os.replace(scratch, self.targets_file)  # atomic: Prometheus never reads half a file

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("prometheus binary not found (apt-get install prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.namespace is not None:
            self.write_targets({})
        config = self._write_config()
        self._log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self._process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"prometheus not ready after {timeout} s: {self.log_text()[-2000:]}")

    def log_text(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; the `result` list (empty when there is no data)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll `promql` until it returns data; TimeoutError naming the query otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result or time.monotonic() > deadline:
                break
            time.sleep(self.scrape_interval / 2)
        if not result:
            raise TimeoutError(f"no data for {promql!r} after {timeout} s")
        return result

    def targets_health(self) -> list[str]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5) as response:
            return [t["health"] for t in json.load(response)["data"]["activeTargets"]]

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
