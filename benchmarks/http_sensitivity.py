"""Which CPU beside a served engine costs it throughput: the server's event loop's, or the client's.

    .venv/bin/python benchmarks/http_sensitivity.py [--spin-us 20] [--pairs 8]

`peer_serve.py`'s main workload (32 streamed requests, 16 at a time, the GGUF defaults) through
`pagoda bench serve`'s client, in alternated pairs of runs, each run a prompt set of its own:
- the server's event loop: a `pagoda serve` as it is against one whose SSE frames each spin
  `--spin-us` first (on the event loop, with the GIL held, where the server's per-token work runs);
- the client: one `pagoda serve`, the bench client as it is against one whose events each spin
  `--spin-us` before they are parsed (in the client's process).
Both add about the same CPU per run. Prints each pair, the medians, and the loaded side's throughput
over the plain side's (median of the pairs), with the CPU seconds each side's event loop and client
took. The spin is this benchmark's own (a `sitecustomize` in a temporary folder for the server);
nothing in pagoda changes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from http_cost import MAIN, MODEL, start_server
from pagoda.server.bench import client as bench_client
from pagoda.server.bench.client import Target
from pagoda.server.bench.runner import run_benchmark
from peer_serve import cpu_seconds

SERVER_SPIN = """
import os, time
_spin = float(os.environ["PAGODA_BENCH_FRAME_SPIN_US"]) / 1e6
import pagoda.server.api.sse as _sse
_frame = _sse.frame
def _spinning_frame(payload):
    end = time.perf_counter() + _spin
    while time.perf_counter() < end:
        pass
    return _frame(payload)
_sse.frame = _spinning_frame
"""


def spinning(function: Callable, spin_us: float) -> Callable:
    def spun(*args):
        end = time.perf_counter() + spin_us / 1e6
        while time.perf_counter() < end:
            pass
        return function(*args)

    return spun


async def served_run(base_url: str, seed: int) -> float:
    requests = MAIN.requests(seed)
    start = time.perf_counter()
    results, _ = await run_benchmark(
        Target(base_url, MODEL, ignore_eos=True), requests, max_concurrency=MAIN.concurrency, progress=False
    )
    seconds = time.perf_counter() - start
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return sum(r.output_tokens for r in results) / seconds


def measured(pid: int, base_url: str, seed: int) -> tuple[float, float, float]:
    """(tok/s, server event-loop CPU s, client CPU s) of one run."""
    before = cpu_seconds(pid)
    throughput = asyncio.run(served_run(base_url, seed))
    after = cpu_seconds(pid)
    return throughput, *(after[k] - before[k] for k in ("server_main_thread_cpu_s", "client_cpu_s"))


def report(title: str, runs: dict[str, list[tuple[float, float, float]]]) -> None:
    print(f"\n{title}")
    for name, values in runs.items():
        tps, loop, client = (statistics.median(v[i] for v in values) for i in range(3))
        print(f"  {name:8s} {tps:7.1f} tok/s   event loop {loop:.3f} CPU-s   client {client:.3f} CPU-s")
    plain, loaded = runs.values()
    ratios = [b[0] / a[0] for a, b in zip(plain, loaded, strict=True)]
    print(
        f"  loaded / plain, pair by pair: {', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spin-us", type=float, default=20.0, help="CPU added per streamed token")
    parser.add_argument("--pairs", type=int, default=8)
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="pagoda-http-sensitivity-")
    folder = Path(scratch.name)
    (folder / "sitecustomize.py").write_text(SERVER_SPIN)
    plain, plain_url = start_server(folder / "plain.log")
    spun_env = {"PYTHONPATH": str(folder), "PAGODA_BENCH_FRAME_SPIN_US": str(args.spin_us)}
    os.environ.update(spun_env)
    try:
        spun, spun_url = start_server(folder / "spun.log")
    finally:
        for key in spun_env:
            del os.environ[key]
    event = bench_client._Stream._event
    server_side: dict[str, list] = {"plain": [], "loaded": []}
    client_side: dict[str, list] = {"plain": [], "loaded": []}
    try:
        for pair in range(args.pairs):
            seed = 20_000 + 10 * pair
            order = [("plain", plain.pid, plain_url), ("loaded", spun.pid, spun_url)]
            for name, pid, url in order[:: 1 if pair % 2 == 0 else -1]:
                server_side[name].append(measured(pid, url, seed))
            for offset, name in enumerate(["plain", "loaded"][:: 1 if pair % 2 == 0 else -1]):
                bench_client._Stream._event = spinning(event, args.spin_us) if name == "loaded" else event
                client_side[name].append(measured(plain.pid, plain_url, seed + 1 + offset))
            bench_client._Stream._event = event
            print(f"pair {pair}: server side {server_side['loaded'][-1][0] / server_side['plain'][-1][0]:.3f}, "
                  f"client side {client_side['loaded'][-1][0] / client_side['plain'][-1][0]:.3f}", flush=True)  # fmt: skip
    finally:
        bench_client._Stream._event = event
        for process in (plain, spun):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
        scratch.cleanup()
    report(f"+{args.spin_us:g} µs per token on the server's event loop", server_side)
    report(f"+{args.spin_us:g} µs per token in the client", client_side)
    return 0


if __name__ == "__main__":
    sys.exit(main())
