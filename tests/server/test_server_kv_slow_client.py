"""Slow /kv/events clients do not slow the engine: the same load, alternately without and with event
streams that never read (their sockets fill and their handlers wait) or read a trickle, against a
real `pagoda serve`; the mean step time comes from /metrics (forward seconds / steps).
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.pagoda_serve import metric_value, pagoda_serve
from support.tiny_models import tiny_model_dir

MODEL = "tiny"
# Small blocks so the load records many events (an allocation and a hash every 4 tokens per sequence).
FLAGS = ["--served-model-name", MODEL, "--num-blocks", "1024", "--block-size", "4", "--max-num-seqs", "8",
         "--max-model-len", "256"]  # fmt: skip
STALLED, TRICKLING = 6, 2


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    model = tiny_model_dir("llama", tmp_path_factory)
    with pagoda_serve(model, FLAGS, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


def load(url: str, round_: int) -> None:
    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Round {round_} request {i}: tell me a story.", "max_tokens": 160,
                "ignore_eos": True}  # fmt: skip
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))


def mean_step_seconds(url: str, round_: int) -> float:
    seconds, steps = metric_value(url, "pagoda_step_forward_seconds_total"), steps_done(url)
    load(url, round_)
    return (metric_value(url, "pagoda_step_forward_seconds_total") - seconds) / (steps_done(url) - steps)


def steps_done(url: str) -> float:
    return metric_value(url, "pagoda_step_bound_total")  # both sides: every step is on one


def open_stream(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few events
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /kv/events?since=0 HTTP/1.1\r\nHost: localhost\r\n\r\n")
    return sock


def test_slow_event_clients_do_not_change_step_times(pod):
    port = int(pod.rsplit(":", 1)[1])
    load(pod, -1)  # warm-up
    baseline, loaded = [], []
    for round_ in range(3):
        baseline.append(mean_step_seconds(pod, 2 * round_))
        streams = [open_stream(port) for _ in range(STALLED + TRICKLING)]
        stop = threading.Event()

        def trickle(sock: socket.socket, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                if not sock.recv(512):
                    return
                time.sleep(0.05)

        readers = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in streams[STALLED:]]
        for reader in readers:
            reader.start()
        loaded.append(mean_step_seconds(pod, 2 * round_ + 1))
        stop.set()
        for sock in streams:
            sock.close()
    state = json.load(urllib.request.urlopen(pod + "/kv/state", timeout=30))
    assert state["counters"]["events_recorded"] > 4096  # more than the ring: stalled streams fell behind it
    base, slow = statistics.median(baseline), statistics.median(loaded)
    print(f"mean step time: without event streams {base * 1e3:.2f} ms {[round(b * 1e3, 2) for b in baseline]}, "
          f"with {STALLED} stalled + {TRICKLING} trickling {slow * 1e3:.2f} ms {[round(s * 1e3, 2) for s in loaded]}")  # fmt: skip
    assert slow < 1.25 * base + 0.5e-3, (baseline, loaded)
