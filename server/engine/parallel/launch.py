"""Starting this node's tensor-parallel worker processes and watching them.

Workers follow torchrun's conventions: each is `python -m pagoda.server.engine.parallel.worker` with
MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK in its environment. On one node rank 0 (the
serving process) starts ranks 1..N-1 and rendezvouses on a free loopback port; across nodes (a
LeaderWorkerSet) each pod starts its own ranks and the leader's address comes from the environment.
A watchdog thread notices a local worker that exits and reports it at once: a step would otherwise
wait for it until the collective timeout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.cpu import usable_cores

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2


class WorkerDiedError(RuntimeError):
    pass


def ranks_per_node(args: EngineArgs) -> int:
    size, nodes = args.tensor_parallel_size, args.nnodes
    if nodes < 1 or size % nodes:
        raise ValueError(f"tensor_parallel_size: {size} ranks do not split evenly over {nodes} nodes")
    return size // nodes


def with_rank_threads(args: EngineArgs) -> EngineArgs:
    """On CPU the node's cores are shared: each local rank gets its part of them."""
    if args.cpu_threads is not None:
        return args
    base = int(os.environ.get("OMP_NUM_THREADS") or usable_cores())
    return dataclasses.replace(args, cpu_threads=max(1, base // ranks_per_node(args)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_workers(args: EngineArgs, ranks: range, addr: str, port: int) -> list[subprocess.Popen]:
    per_node = ranks_per_node(args)
    payload = json.dumps(dataclasses.asdict(args))
    procs = []
    for rank in ranks:
        env = {
            **os.environ,
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(args.tensor_parallel_size),
            "LOCAL_RANK": str(rank % per_node),
        }
        cmd = [sys.executable, "-m", "pagoda.server.engine.parallel.worker", payload]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


class Watchdog:
    """Polls local worker processes; the first one that exits fails the group (`on_failure`)."""

    def __init__(self, procs: list[subprocess.Popen], first_rank: int) -> None:
        self.procs, self.first_rank = procs, first_rank
        self.failure: WorkerDiedError | None = None
        self.listeners: list[Callable[[BaseException], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pagoda-tp-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None:
                    self.fail(WorkerDiedError(f"tensor-parallel rank {self.first_rank + i} exited ({code})"))
                    return

    def fail(self, error: WorkerDiedError) -> None:
        if self.failure is not None:
            return
        self.failure = error
        logger.error("%s: the group cannot serve any more", error)
        for listener in list(self.listeners):
            listener(error)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop watching, then wait for the workers (told to stop already); kill what is left."""
        self._stop.set()
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        self._stop.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _health_server(address: tuple[str, int], watchdog: Watchdog):
    """/health and /ready: 200 while every local rank runs, else 503 (the pod's probes)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/health", "/ready"):
                self.send_error(404)
                return
            ok = watchdog.failure is None
            body = b"ok" if ok else str(watchdog.failure).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_) -> None:  # probes every few seconds: no access log
            pass

    server = ThreadingHTTPServer(address, Health)
    threading.Thread(target=server.serve_forever, name="pagoda-worker-health", daemon=True).start()
    return server


def run_node(args: EngineArgs, node_rank: int, addr: str, port: int, health: tuple[str, int]) -> int:
    """Run node `node_rank`'s ranks until one exits; its exit code (the others are stopped)."""
    import signal

    args = with_rank_threads(args)
    per_node = ranks_per_node(args)
    if node_rank >= args.nnodes:
        raise ValueError(f"node_rank: {node_rank} is not below nnodes {args.nnodes}")
    first = node_rank * per_node
    procs = spawn_workers(args, range(first, first + per_node), addr, port)
    watchdog = Watchdog(procs, first_rank=first)
    done = threading.Event()
    watchdog.listeners.append(lambda _: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    server = _health_server(health, watchdog)
    done.wait()
    codes = [proc.poll() for proc in procs]
    watchdog.kill()
    server.shutdown()
    # 0: stopped by SIGTERM, or rank 0 told every rank to stop; else the failed rank's code (a
    # signal death as a shell reports it, 128 + n)
    code = next((code for code in codes if code), 0)
    return 128 - code if code < 0 else code
