"""The offline engine beside a small foreign CPU load: what a client, an event loop or a neighbour
costs the engine's steps when the engine's threads already fill the cores.

    .venv/bin/python benchmarks/offline_under_load.py [--busy-us 100 --sleep-us 1100 --runs 6]

Runs `peer_serve.py`'s main workload on the offline engine (the GGUF defaults, each run in a process of
its own with prompts of its own), in pairs: alone, then beside a process that spins for `busy` µs and
sleeps for `sleep` µs, over and over. Prints each pair, the load's share of the host, and the median
ratio. An engine step is a team of threads that meet at every kernel's end: a core taken from one of
them for a moment stalls the other too, so the loss is a multiple of the load's share.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_serve import offline_main_run

SPIN = """
import sys, time
busy, rest = float(sys.argv[1]) * 1e-6, float(sys.argv[2]) * 1e-6
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(rest)
"""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--busy-us", type=float, default=100.0, help="the load spins this long ...")
    parser.add_argument("--sleep-us", type=float, default=1100.0, help="... then sleeps this long")
    parser.add_argument("--runs", type=int, default=6, help="pairs of runs")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    share = args.busy_us / (args.busy_us + args.sleep_us) / cores
    print(f"load: {args.busy_us:.0f} µs busy, {args.sleep_us:.0f} µs asleep = {share:.1%} of {cores} cores")
    ratios = []
    for run in range(args.runs):
        prompts = 1000 + run  # prompt sets of their own: no run meets another's prefix cache
        alone = offline_main_run(prompts)["offline_output_throughput"]
        load = subprocess.Popen([sys.executable, "-c", SPIN, str(args.busy_us), str(args.sleep_us)])
        try:
            loaded = offline_main_run(prompts)["offline_output_throughput"]
        finally:
            load.kill()
            load.wait()
        ratios.append(loaded / alone)
        print(
            f"run {run}: alone {alone:.1f} tok/s, beside the load {loaded:.1f} tok/s = {ratios[-1]:.2f}",
            flush=True,
        )
    print(
        f"median: {statistics.median(ratios):.2f} of the throughput alone, the load taking {share:.1%} of the host"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
