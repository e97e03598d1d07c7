"""`pagoda bench serve`: load-test any OpenAI-compatible server (ours, vLLM, ...) with a random workload."""

from __future__ import annotations

import argparse

HELP = "benchmarks: `pagoda bench serve` load-tests an OpenAI-compatible server"


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server URL (with or without /v1)"
    )
    parser.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--api-key", help="bearer token for servers started with --api-key")
    parser.add_argument(
        "--num-prompts",
        type=_int_list,
        default=[100],
        help="requests per run (a list pairs with --max-concurrency)",
    )
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf = all at once"
    )
    parser.add_argument(
        "--max-concurrency",
        type=_int_list,
        help="most requests in flight at once (default: no cap); a list such as 1,8,32,64 runs a sweep",
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean)")
    parser.add_argument(
        "--output-len", type=int, default=64, help="output tokens (mean; exact with ignore_eos)"
    )
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len·[1-r, 1+r]")
    parser.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of one prefix shared by all")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        help="build prompts from random token ids of this tokenizer (`default` = the embedded model's, "
        "an HF folder or a .gguf); without it prompts are random words",
    )
    parser.add_argument("--save-result", metavar="JSON", help="write the summaries and per-request results")
    parser.add_argument("--plot", metavar="PNG", help="write a latency-vs-time plot (of the last run)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--offline",
        action="store_true",
        help="also run each workload through the offline engine in this process (same concurrency) and "
        "print the HTTP/offline throughput ratio; serve and offline must use the same model and flags",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each point this many times (HTTP and offline alternating) and keep the best of each: "
        "on a shared machine the best run is the one least disturbed by other load",
    )
    parser.add_argument("--offline-model", help="model for --offline (default: the embedded default)")
    parser.add_argument(
        "--offline-kv-cache-memory", help="KV pool for --offline, e.g. 2GiB (default: engine's)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    serve = sub.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP")
    _add_serve_arguments(serve)


async def _first_model(base_url: str, api_key: str | None) -> str:
    import aiohttp

    base = base_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session, session.get(f"{base}/models", headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def _run_http(args: argparse.Namespace, requests, max_concurrency: int | None):
    from pagoda.server.bench.client import Target
    from pagoda.server.bench.runner import run_benchmark

    model = args.model or await _first_model(args.base_url, args.api_key)
    target = Target(args.base_url, model, args.endpoint, args.api_key, args.temperature)
    await run_benchmark(target, requests[:1], progress=False)  # warm-up, untimed
    return await run_benchmark(
        target, requests, args.request_rate, max_concurrency, args.seed, progress=not args.no_progress
    )


def _markdown(rows: list[dict]) -> str:
    lines = [
        "| concurrency | prompts | output tok/s | req/s | median TTFT (ms) | p99 TTFT (ms) | median TPOT (ms) "
        "| p99 TPOT (ms) | offline tok/s | HTTP/offline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        offline = r.get("offline_output_throughput")
        ratio = r.get("http_offline_ratio")
        lines.append(
            f"| {r['max_concurrency'] or 'none'} | {r['successful_requests']} | {r['output_throughput']:.1f} "
            f"| {r['request_throughput']:.2f} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} "
            f"| {r['median_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} "
            f"| {f'{offline:.1f}' if offline else '-'} | {f'{ratio:.3f}' if ratio else '-'} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import asyncio

    from pagoda.server.bench.dataset import load_tokenizer, random_requests
    from pagoda.server.bench.report import format_table, plot, save_result, summarize
    from pagoda.server.engine.config import parse_bytes

    concurrencies = args.max_concurrency or [None]
    counts = args.num_prompts * len(concurrencies) if len(args.num_prompts) == 1 else args.num_prompts
    if len(counts) != len(concurrencies):
        raise SystemExit("--num-prompts: give one count, or one per --max-concurrency value")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    baseline = None
    if args.offline:
        from pagoda.server.bench.offline import OfflineBaseline

        engine_kwargs = {"model": args.offline_model}
        if args.offline_kv_cache_memory:
            engine_kwargs["kv_cache_memory"] = parse_bytes(args.offline_kv_cache_memory)
        baseline = OfflineBaseline(engine_kwargs)
    rows, saved, failed = [], [], 0
    for concurrency, count in zip(concurrencies, counts, strict=True):
        requests = random_requests(
            count,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.shared_prefix_len,
            args.seed,
            tokenizer,
        )
        http_runs, offline_runs = [], []
        for _ in range(args.repeats):  # HTTP and offline alternate, so both see the same machine load
            results, duration = asyncio.run(_run_http(args, requests, concurrency))
            http_runs.append(({"max_concurrency": concurrency, **summarize(results, duration)}, results))
            if baseline is not None:
                offline_runs.append(baseline.run(requests, concurrency, args.temperature))
        summary, results = max(http_runs, key=lambda run: run[0]["output_throughput"])
        if offline_runs:
            summary |= max(offline_runs, key=lambda run: run["offline_output_throughput"])
            summary["http_offline_ratio"] = (
                summary["output_throughput"] / summary["offline_output_throughput"]
            )
        print(
            format_table(summary, f"Serving benchmark, max concurrency {concurrency or 'none'}"), flush=True
        )
        rows.append(summary)
        saved.append((summary, results))
        failed += summary["failed_requests"]
        if args.plot:
            plot(args.plot, results)
    if len(rows) > 1:
        print(_markdown(rows))
    if args.save_result:
        config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        save_result(args.save_result, saved, config)
    return 0 if failed == 0 else 1
