"""pagoda serve against its peers on this machine, one after the other in one run, each with its defaults.

    benchmarks/setup_peers.sh                        # once: the peers, each in a venv of its own
    .venv/bin/python benchmarks/peer_serve.py --out benchmarks/results/peer_serve

Servers (same model: the embedded SmolLM2-135M-Instruct; the HF folders are written once from its GGUF,
so every server reads the same weights): an fp32 checkpoint (the GGUF's values), and the same weights
rounded to bf16 saved in bf16 (as SmolLM2's published checkpoint is), which the fp32 rows serve too:
- `pagoda serve` with no flags (the GGUF: bf16 on CPUs with native bf16, its Q4/Q8 weights for
  few-row steps), `pagoda serve --model <HF folder> --dtype D` for each dtype D, and the bf16 folder
  with `--quantization int4` (4-bit copies made at load, set against llama.cpp and transformers bf16);
- `transformers serve --continuous-batching --dtype D` on the HF folder;
- llama.cpp's OpenAI server (llama-cpp-python) on the GGUF, with as many threads as cores (its own
  default here is half the cores; it serves one request at a time);
- pagoda's offline engine on the main workload (what HTTP costs), each run in a process of its own
  right after the GGUF server's run of the same prompts, the server up and idle: the two see the same
  minutes of the host (its speed moves by 5-10 % within minutes), so HTTP / offline is the median of
  those pairs' ratios (the ratio of the two medians beside it).

Workloads (streamed completions of random-word prompts, greedy, `ignore_eos` where the server honours it;
throughput counts the tokens each server reports): the main one (32 requests, prompts of 5-125 words,
16-64 output tokens, concurrency 16; three runs with prompts of their own, the median counts), the
same shape at concurrency 1 (8 requests) and 64 (64 requests), and one request of 128 tokens at a time
(ms per output token; three runs of two requests, the median counts). Prints markdown tables with ratios, and each dense pagoda row's
one stream against the weight-read floor (the model's weight bytes over a 1 GiB `sum`'s bandwidth,
read just before and after each of its runs: a shared host's bandwidth moves by half within minutes), and
the CPU seconds the client and the server's event loop took in a main run (on a host whose cores the
engine fills, that CPU is much of what HTTP costs: `http_cost.py` splits the rest); --out writes
JSON + markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]  # the one free_port: tests/support

from host_bandwidth import dram_read_gbps  # noqa: E402
from pagoda.server.bench.client import Target  # noqa: E402
from pagoda.server.bench.dataset import BenchRequest, random_requests  # noqa: E402
from pagoda.server.bench.report import summarize  # noqa: E402
from pagoda.server.bench.runner import run_benchmark  # noqa: E402
from support.prometheus import free_port  # noqa: E402

PEERS = ROOT / "benchmarks" / ".peers"
GGUF_DEFAULTS = "pagoda (GGUF, defaults)"
HF_INT4 = "pagoda (bf16 checkpoint, int4)"  # the HF folder's own 4-bit copies, against llama.cpp too


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    concurrency: int
    input_words: tuple[int, int]  # prompt length range, words
    output_tokens: tuple[int, int]
    runs: int = 1  # each with prompts of its own (a prefix cache gains nothing); the median counts

    def requests(self, run: int = 0) -> list[BenchRequest]:
        (lo_in, hi_in), (lo_out, hi_out) = self.input_words, self.output_tokens
        mean_in, mean_out = (lo_in + hi_in) / 2, (lo_out + hi_out) / 2
        return random_requests(
            self.num_prompts,
            round(mean_in),
            round(mean_out),
            range_ratio=min((hi_in - lo_in) / 2 / mean_in, (hi_out - lo_out) / 2 / mean_out, 0.99),
            seed=1 + run,
        )


def median_run(summaries: list[dict], key: str) -> dict:
    """The run with the median `key` (of an odd number of runs), with every run's `key` beside it."""
    ranked = sorted(summaries, key=lambda s: s[key])
    return {**ranked[len(ranked) // 2], f"runs_{key}": [s[key] for s in summaries]}


# The main workload and the one stream run three times per server: one run of either lasts 2-3 s for
# pagoda, where this host's speed moves by 5-10 % from one run to the next (one stream by up to a
# third: 11.5 ms a token in a full run, 8.8-10.1 in 14 checks within the half hour).
WORKLOADS = [
    Workload("c16 (main)", 32, 16, (5, 125), (16, 64), runs=3),
    Workload("c1", 8, 1, (5, 125), (16, 64)),
    Workload("c64", 64, 64, (5, 125), (16, 64)),
    Workload("single 128 tokens", 2, 1, (20, 20), (128, 128), runs=3),
]


@dataclass
class Server:
    label: str
    argv: list[str]
    model: str  # the name requests carry
    env: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = True  # transformers serve refuses the field (422)
    weight_bytes: int = 0  # pagoda on an HF folder: bytes a weight needs; its one stream meets the floor
    results: dict[str, dict] = field(default_factory=dict)


def hf_folder_from_gguf(folder: Path, dtype: str = "float32") -> Path:
    """The embedded GGUF, dequantized (transformers' GGUF reader, via pagoda's loader), as an HF folder
    of safetensors in `dtype`; written once."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from pagoda.server.engine.loader import load_model
    from safetensors.torch import save_file

    loaded = load_model(None, dtype="float32")
    folder.mkdir(parents=True, exist_ok=True)
    cast = getattr(torch, dtype)
    tensors = {name: t.to(cast).contiguous() for name, t in loaded.model.checkpoint_targets().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded.hf_config.torch_dtype = dtype
    loaded.hf_config.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


def servers(dtypes: list[str], folder: Path, bf16_folder: Path, cores: int) -> list[Server]:
    from pagoda.server.engine.loader import default_gguf_path

    pagoda = [str(ROOT / ".venv" / "bin" / "pagoda"), "serve", "--host", "127.0.0.1"]
    found = [
        Server(GGUF_DEFAULTS, pagoda, "SmolLM2-135M-Instruct"),
        Server(
            f"llama.cpp (GGUF, {cores} threads)",
            [
                str(PEERS / "llamacpp" / "bin" / "python"),
                "-m",
                "llama_cpp.server",
                "--host",
                "127.0.0.1",
                "--model",
                str(default_gguf_path()),
                "--model_alias",
                "smollm2",
                "--n_threads",
                str(cores),
                "--n_threads_batch",
                str(cores),
            ],
            "smollm2",
        ),
    ]
    if "bfloat16" in dtypes:
        found.append(
            Server(
                HF_INT4,
                [*pagoda, "--model", str(bf16_folder), "--dtype", "bfloat16", "--quantization", "int4"],
                bf16_folder.name,
            )
        )
    rows = [(dtype, folder, "") for dtype in dtypes]
    if "float32" in dtypes:  # fp32 on a checkpoint of bf16 values: pagoda keeps them in bf16
        rows.append(("float32", bf16_folder, ", bf16 checkpoint"))
    for dtype, checkpoint, note in rows:
        found.append(
            Server(
                f"pagoda ({dtype}{note})",
                [*pagoda, "--model", str(checkpoint), "--dtype", dtype],
                checkpoint.name,
                weight_bytes=2 if dtype == "bfloat16" or note else 4,
            )
        )
        found.append(
            Server(
                f"transformers serve CB ({dtype}{note})",
                [
                    str(PEERS / "transformers" / "bin" / "transformers"),
                    "serve",
                    "--continuous-batching",
                    "--host",
                    "127.0.0.1",
                    "--dtype",
                    dtype,
                    str(checkpoint),
                ],
                str(checkpoint),
                ignore_eos=False,
            )
        )
    return found


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"not ready after {timeout:.0f} s: {log.read_text()[-2000:]}")


async def warm_up(target: Target, timeout: float = 900.0) -> None:
    """Short requests until one succeeds: the model is loaded (pagoda loads after its port opens,
    transformers serve on first use) and warm before anything is timed."""
    warm = [BenchRequest("Hello there", "Hello there", 2, 8)]
    deadline = time.monotonic() + timeout
    while True:
        results, _ = await run_benchmark(target, warm, progress=False, timeout=timeout)
        if results[0].success:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up request failed: {results[0].error}")
        await asyncio.sleep(1)


def run_server(server: Server, out: Path, after_main_run: Callable[[int], None] | None = None) -> None:
    """Every workload against `server`; `after_main_run(run)` after each run of the main one, the
    server up and idle."""
    port = free_port()
    log = out / f"{server.label.split(' ')[0]}-{port}.log"
    # cwd outside the repo: its `operator/` folder would shadow the stdlib module of peers' Pythons.
    with log.open("w") as handle:
        process = subprocess.Popen(
            [*server.argv, "--port", str(port)],
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=out,
            env={**os.environ, "PYTHONSAFEPATH": "1", **server.env},
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}/v1/models", process, log)
        target = Target(base, server.model, ignore_eos=server.ignore_eos)
        asyncio.run(warm_up(target))
        for workload in WORKLOADS:
            # a dense row's one stream is set against the floor at the bandwidth of that moment: each
            # run between two reads of it
            around_floor = workload is WORKLOADS[3] and server.weight_bytes > 0
            reads = [dram_read_gbps()] if around_floor else []
            runs = []
            for run in range(workload.runs):
                cpu_before = cpu_seconds(process.pid)
                results, duration = asyncio.run(
                    run_benchmark(
                        target,
                        workload.requests(run),
                        max_concurrency=workload.concurrency,
                        progress=False,
                        timeout=1800,
                    )
                )
                cpu_used = {key: now - cpu_before[key] for key, now in cpu_seconds(process.pid).items()}
                runs.append({**summarize(results, duration), **cpu_used})
                if around_floor:
                    reads.append(dram_read_gbps())
                if after_main_run is not None and workload is WORKLOADS[0]:
                    after_main_run(run)
            server.results[workload.name] = median_run(runs, "output_throughput")
            if around_floor:
                server.results[workload.name]["runs_tpot_and_dram"] = [
                    (r["mean_tpot_ms"], reads[i : i + 2]) for i, r in enumerate(runs)
                ]
            print(
                f"  {server.label:34s} {workload.name:18s} {_line(server.results[workload.name])}", flush=True
            )
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of this process (the client) and of the server's main thread (pagoda's
    event loop). On 2 cores every CPU second beside the engine's two threads slows its steps: the
    HTTP / offline line quotes both."""
    run_ns = int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])  # ns, not 10 ms ticks
    return {"client_cpu_s": time.process_time(), "server_main_thread_cpu_s": run_ns / 1e9}


def _line(summary: dict) -> str:
    return (
        f"{summary['output_throughput']:7.1f} tok/s  TPOT {summary['mean_tpot_ms']:6.1f} ms  "
        f"failed {summary['failed_requests']}"
    )


def child_run(script: str, *args: str) -> dict:
    """`script args` in a process of its own, its last line of output a JSON object: nothing of an
    engine run there (threads, memory) stays behind in the client's process."""
    result = subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def offline_main_run(run: int) -> dict:
    """Run `run` of the main workload on pagoda's offline engine (the GGUF defaults)."""
    return child_run(__file__, "--offline-run", str(run))


def _offline_run_here(run: int) -> None:
    from pagoda.server.bench.offline import OfflineBaseline

    main = WORKLOADS[0]
    print(json.dumps(OfflineBaseline({}).run(main.requests(run), max_concurrency=main.concurrency)))


def weights_per_token(folder: Path) -> int:
    """Weights a one-row decode step reads: every parameter once (a tied embedding as the LM head)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())  # noqa: SIM118 (not a dict)


def floor_lines(found: list[Server], folder: Path, bandwidths: list[float]) -> list[str]:
    """One stream of each dense pagoda row against the weight-read floor, run by run: each run's time
    per token over the floor at the higher of the bandwidths read just before and after it; the
    median of those ratios counts."""
    params = weights_per_token(folder)
    lines = ["", f"DRAM read (1 GiB `sum`, start / end of the run): {' / '.join(f'{b:.1f}' for b in bandwidths)} GB/s"]
    for server in found:
        single = server.results.get(WORKLOADS[3].name)
        if not server.weight_bytes or not single:
            continue
        runs = single["runs_tpot_and_dram"]  # every dense row's one stream has them (`run_server`)
        ratios = []
        for tpot_ms, around in runs:
            floor_ms = params * server.weight_bytes / (max(around) * 1e9) * 1e3
            ratios.append(tpot_ms / floor_ms)
        cells = ", ".join(
            f"{tpot:.1f} ms at {'/'.join(f'{b:.0f}' for b in around)} GB/s = {r:.2f}x"
            for (tpot, around), r in zip(runs, ratios, strict=True)
        )
        lines.append(
            f"{server.label}, 1 stream: {statistics.median_high(ratios):.2f}x the weight-read floor, median of "
            f"its runs ({params / 1e6:.0f}M weights; each run against the DRAM read just before / after it: "
            f"{cells})"
        )
    return lines


def markdown(found: list[Server], offline: dict | None) -> str:
    by_label = {s.label: s for s in found}
    lines = [
        "| server | " + " | ".join(f"{w.name} tok/s" for w in WORKLOADS[:3]) + " | ms/token (1 stream) |"
    ]
    lines.append("|---" * 5 + "|")
    for server in found:
        cells = [
            f"{server.results[w.name]['output_throughput']:.1f}"
            for w in WORKLOADS[:3]
            if w.name in server.results
        ]
        single = server.results.get(WORKLOADS[3].name)
        cells.append(f"{single['mean_tpot_ms']:.1f}" if single else "-")
        lines.append(f"| {server.label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| ratio | " + " | ".join(w.name for w in WORKLOADS[:3]) + " | ms/token (lower is better) |",
    ]
    lines.append("|---" * 5 + "|")
    pairs = [(ours, s.label) for ours in (GGUF_DEFAULTS, HF_INT4) for s in found if s.label.startswith("llama.cpp")]
    pairs += [
        (s.label, s.label.replace("pagoda", "transformers serve CB"))
        for s in found
        if s.label.startswith("pagoda (") and s.label not in (GGUF_DEFAULTS, HF_INT4)
    ]
    pairs.append((HF_INT4, "transformers serve CB (bfloat16)"))
    for ours, peer in pairs:
        if ours not in by_label or peer not in by_label:
            continue
        a, b = by_label[ours].results, by_label[peer].results
        cells = [
            f"{a[w.name]['output_throughput'] / b[w.name]['output_throughput']:.2f}x"
            for w in WORKLOADS[:3]
            if w.name in a and w.name in b and b[w.name]["output_throughput"]
        ]
        single = WORKLOADS[3].name
        if single in a and single in b:
            cells.append(f"{a[single]['mean_tpot_ms']:.1f} vs {b[single]['mean_tpot_ms']:.1f}")
        lines.append(f"| {ours} / {peer} | " + " | ".join(cells) + " |")
    if offline is not None and GGUF_DEFAULTS in by_label:
        served = by_label[GGUF_DEFAULTS].results[WORKLOADS[0].name]
        http, alone = served["output_throughput"], offline["offline_output_throughput"]
        runs_both = list(zip(served["runs_output_throughput"], offline["runs_offline_output_throughput"], strict=True))
        paired = statistics.median_high(a / b for a, b in runs_both)
        runs = " / ".join(f"{a:.1f} vs {b:.1f} = {a / b:.2f}" for a, b in runs_both)
        lines += [
            "",
            f"HTTP / offline ({WORKLOADS[0].name}, default threads, {WORKLOADS[0].runs} runs, each served run "
            f"against the offline run of its prompts right after it): {paired:.2f}, the median "
            f"of the runs' ratios ({runs}); the medians' ratio {http:.1f} / {alone:.1f} tok/s = {http / alone:.2f}. "
            f"In the median served run of {served['duration_s']:.2f} s the client used "
            f"{served['client_cpu_s']:.2f} s of CPU and the server's event loop "
            f"{served['server_main_thread_cpu_s']:.2f} s",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peer_serve")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="dtypes for the HF-folder servers")
    parser.add_argument("--only", help="comma-separated label prefixes to run (e.g. 'pagoda,llama.cpp')")
    parser.add_argument("--offline-run", type=int, help=argparse.SUPPRESS)  # offline_main_run's child
    args = parser.parse_args()
    if args.offline_run is not None:
        _offline_run_here(args.offline_run)
        return 0
    args.out = args.out.resolve()  # servers run with the output folder as their cwd
    args.out.mkdir(parents=True, exist_ok=True)
    folder = hf_folder_from_gguf(args.out / "SmolLM2-135M-Instruct")
    bf16_folder = hf_folder_from_gguf(args.out / "SmolLM2-135M-Instruct-bf16", "bfloat16")
    cores = len(os.sched_getaffinity(0))
    found = servers(args.dtypes.split(","), folder, bf16_folder, cores)
    if args.only:
        found = [s for s in found if s.label.startswith(tuple(args.only.split(",")))]
    bandwidths = [dram_read_gbps()]
    offline_runs: list[dict] = []

    def offline_after(run: int) -> None:  # the GGUF server's prompts of that run, in the same minutes
        offline_runs.append(offline_main_run(run))

    for server in found:
        print(f"{server.label}: {' '.join(server.argv)}", flush=True)
        try:
            run_server(server, args.out, offline_after if server.label == GGUF_DEFAULTS else None)
        except Exception as exc:  # a peer that fails to start is reported, not fatal
            print(f"  {server.label} failed: {exc}", flush=True)
    offline = median_run(offline_runs, "offline_output_throughput") if offline_runs else None
    if offline is not None:
        print(f"  {'offline engine':34s} {WORKLOADS[0].name:18s} {offline['offline_output_throughput']:7.1f} tok/s")
    bandwidths.append(dram_read_gbps())
    report = "\n".join([markdown(found, offline), *floor_lines(found, folder, bandwidths)])
    print(report)
    (args.out / "peer_serve.md").write_text(report + "\n")
    (args.out / "peer_serve.json").write_text(
        json.dumps({"servers": {s.label: s.results for s in found}, "offline": offline}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
