"""A real `pagoda serve --tensor-parallel-size 2` on CPU: it answers like one rank, and a worker that
dies takes /health to 503 and the server down with a non-zero exit within seconds (never a hang)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from support.pagoda_serve import metric_value, pagoda_serve_process
from support.tiny_models import tiny_model_dir

FLAGS = ["--dtype", "float32", "--num-blocks", "64", "--block-size", "8", "--max-model-len", "128"]
PROMPT = "The capital of France is"


def children(pid: int) -> list[int]:
    """Child processes of `pid`, whichever of its threads started them."""
    return [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]


def complete(url: str) -> tuple[str, list[float]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    choice = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1
    ).choices[0]
    return choice.text, choice.logprobs.token_logprobs


def health(url: str) -> int | None:
    """/health's status; None when the server no longer answers (it is exiting)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


@pytest.mark.slow
def test_two_ranks_answer_like_one_and_die_with_a_worker(tmp_path, tmp_path_factory):
    model = tiny_model_dir("llama", tmp_path_factory)
    with pagoda_serve_process(model, FLAGS, tmp_path / "tp1.log") as (url, _):
        expected_text, expected_logprobs = complete(url)
    with pagoda_serve_process(model, [*FLAGS, "--tensor-parallel-size", "2"], tmp_path / "tp2.log") as (
        url,
        server,
    ):
        text, logprobs = complete(url)
        assert text == expected_text
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)
        assert health(url) == 200
        (worker,) = children(server.pid)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        statuses = []  # (seconds after the kill, /health status or None once it does not answer)
        while server.poll() is None and time.monotonic() - killed < 15:
            statuses.append((time.monotonic() - killed, health(url)))
            time.sleep(0.1)
        assert server.poll() is not None, "the server still runs 15 s after its worker died"
        assert server.returncode != 0
        print(f"server exited {server.returncode} {time.monotonic() - killed:.1f} s after the kill")
        failed_at = next(t for t, status in statuses if status != 200)
        assert failed_at < 3, statuses
        assert all(status != 200 for t, status in statuses if t >= failed_at), statuses
        log = (tmp_path / "tp2.log").read_text()
        assert "tensor-parallel rank 1 exited" in log and "engine loop died" in log


def test_health_is_503_once_a_worker_died(start_server):
    """The server in this process (it does not exit here): the watchdog fails the step loop."""
    server = start_server(tensor_parallel_size=2)
    assert health(server.url) == 200
    stats = server.stats()  # the group's capacity: every rank holds its KV heads of the 64 blocks
    assert (stats.tensor_parallel_size, stats.capacity_tokens) == (2, 64 * 16)
    assert stats.kv_cache_bytes == 64 * 16 * 2 * 2 * 4 * 16 * 4  # blocks·tokens·K/V·layers·heads·dim·fp32
    assert metric_value(server.url, "pagoda_tensor_parallel_size") == 2
    (worker,) = [pid for pid in children(os.getpid()) if f"{pid}" in _worker_pids()]
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while health(server.url) != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health(server.url) == 503
    assert server.state.health() == (False, "engine loop is not running")


def _worker_pids() -> set[str]:
    """Pids of processes running the tensor-parallel worker module."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"parallel.worker" in (entry / "cmdline").read_bytes():
                pids.add(entry.name)
        except OSError:
            continue
    return pids


GROUP = ["--tensor-parallel-size", "2", "--nnodes", "2"]


@contextlib.contextmanager
def node_one(model: Path, log: Path, monkeypatch) -> Iterator[tuple[subprocess.Popen, str]]:
    """`pagoda worker --node-rank 1` of a two-node group on loopback: (process, its health URL)."""
    from support.prometheus import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    health_port = free_port()
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "pagoda.cli", "worker", "--model", str(model), *FLAGS, *GROUP,
             "--node-rank", "1", "--host", "127.0.0.1", "--port", str(health_port)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield worker, f"http://127.0.0.1:{health_port}"
    finally:
        if worker.poll() is None:
            worker.kill()


@pytest.mark.slow
def test_a_two_node_group_on_loopback_answers_like_one_rank(tmp_path, tmp_path_factory, monkeypatch):
    """The LeaderWorkerSet layout on one machine: `pagoda serve --nnodes 2` (node 0, rank 0) and
    `pagoda worker --node-rank 1` (rank 1) rendezvous at MASTER_ADDR:MASTER_PORT."""
    model = tiny_model_dir("llama", tmp_path_factory)
    offline = engine_reference(model)
    with node_one(model, tmp_path / "worker.log", monkeypatch) as (worker, worker_url):
        with pagoda_serve_process(model, [*FLAGS, *GROUP], tmp_path / "leader.log") as (url, _):
            text, logprobs = complete(url)
            assert health(worker_url) == 200
        assert (text, logprobs) == (offline[0], pytest.approx(offline[1], abs=1e-5))
        assert worker.wait(timeout=30) == 0  # the leader's stop reached the worker's rank


@pytest.mark.slow
def test_a_worker_node_exits_non_zero_when_its_leader_dies(tmp_path, tmp_path_factory, monkeypatch):
    """The leader pod lost (SIGKILL): the worker pod's rank fails its next receive and `pagoda worker`
    exits non-zero within seconds (LWS then recreates the group)."""
    model = tiny_model_dir("llama", tmp_path_factory)
    with node_one(model, tmp_path / "worker.log", monkeypatch) as (worker, _):
        with pagoda_serve_process(model, [*FLAGS, *GROUP], tmp_path / "leader.log") as (url, leader):
            complete(url)
            leader.kill()
            killed = time.monotonic()
            code = worker.wait(timeout=30)
        assert code != 0
        print(f"pagoda worker exited {code} {time.monotonic() - killed:.1f} s after its leader died")
        assert time.monotonic() - killed < 15


def engine_reference(model: Path) -> tuple[str, list[float]]:
    """What one rank answers (offline, the same sampling as `complete`)."""
    from pagoda.server.engine.llm import LLM
    from pagoda.server.engine.sampling_params import SamplingParams

    llm = LLM(str(model), device="cpu", dtype="float32", num_blocks=64, block_size=8, max_model_len=128)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=1)).pop().outputs[0]
    return out.text, [entry[token] for entry, token in zip(out.logprobs, out.token_ids, strict=True)]
