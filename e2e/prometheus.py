"""An optional real Prometheus for the local e2e: scrapes the serving processes found by file-based
discovery (the pod runner rewrites the file as pods come and go), with the `namespace` and `pod` labels
Kubernetes discovery would attach, so the autoscaler's Prometheus queries work unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from e2e.pod_runner import free_port


class FileDiscoveryPrometheus:
    def __init__(self, workdir: Path, namespace: str, scrape_interval_s: float = 1.0) -> None:
        self.workdir = workdir
        self.namespace = namespace
        self.interval = f"{int(scrape_interval_s * 1000)}ms"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets_file = workdir / "targets.json"
        self._process: subprocess.Popen | None = None

    def write_targets(self, pods: dict[str, str]) -> None:
        groups = [{"targets": [target], "labels": {"namespace": self.namespace, "pod": name}}
                  for name, target in pods.items()]
        scratch = self.targets_file.with_suffix(".tmp")
        scratch.write_text(json.dumps(groups))
        os.replace(scratch, self.targets_file)  # atomic: Prometheus never reads half a file

    def start(self, timeout_s: float = 30.0) -> FileDiscoveryPrometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("--prometheus needs the prometheus binary (apt-get install prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.write_targets({})
        config = {"global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
                  "scrape_configs": [{"job_name": "pagoda", "scrape_timeout": self.interval,
                                      "file_sd_configs": [{"files": [str(self.targets_file)],
                                                           "refresh_interval": "1s"}]}]}
        (self.workdir / "prometheus.yml").write_text(json.dumps(config))
        log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 - owned by the process
        self._process = subprocess.Popen(
            [binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1):
                    return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"prometheus not ready within {timeout_s} s")

    def stop(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
