"""`pagoda bench serve`: load-test any OpenAI-compatible server (ours, vLLM, ...) with a random workload."""

from __future__ import annotations

import argparse

HELP = "benchmarks: `pagoda bench serve` load-tests an OpenAI-compatible server"


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server URL (with or without /v1)"
    )
    parser.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--api-key", help="bearer token for servers started with --api-key")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf = all at once"
    )
    parser.add_argument(
        "--max-concurrency", type=int, help="most requests in flight at once (default: no cap)"
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
    parser.add_argument("--save-result", metavar="JSON", help="write the summary and per-request results")
    parser.add_argument("--plot", metavar="PNG", help="write a latency-vs-time plot")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--offline",
        action="store_true",
        help="also run the same workload through the offline engine in this process and print the "
        "HTTP/offline throughput ratio (serve and offline must use the same model and engine flags)",
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


async def _run_http(args: argparse.Namespace, requests) -> dict:
    from pagoda.server.bench.client import Target
    from pagoda.server.bench.report import plot, save_result, summarize
    from pagoda.server.bench.runner import run_benchmark

    model = args.model or await _first_model(args.base_url, args.api_key)
    target = Target(args.base_url, model, args.endpoint, args.api_key, args.temperature)
    await run_benchmark(target, requests[:1], progress=False)  # warm-up, untimed
    results, duration = await run_benchmark(
        target, requests, args.request_rate, args.max_concurrency, args.seed, progress=not args.no_progress
    )
    summary = summarize(results, duration)
    if args.save_result:
        save_result(
            args.save_result, summary, results, {k: v for k, v in vars(args).items() if k != "_handler"}
        )
    if args.plot:
        plot(args.plot, results)
    return summary


def main(args: argparse.Namespace) -> int:
    import asyncio

    from pagoda.server.bench.dataset import load_tokenizer, random_requests
    from pagoda.server.bench.report import format_table
    from pagoda.server.engine.config import parse_bytes

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    requests = random_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.shared_prefix_len, args.seed,
        tokenizer,
    )  # fmt: skip
    summary = asyncio.run(_run_http(args, requests))
    if args.offline:
        from pagoda.server.bench.offline import run_offline

        engine_kwargs = {"model": args.offline_model}
        if args.max_concurrency:
            engine_kwargs["max_num_seqs"] = args.max_concurrency
        if args.offline_kv_cache_memory:
            engine_kwargs["kv_cache_memory"] = parse_bytes(args.offline_kv_cache_memory)
        summary |= run_offline(requests, engine_kwargs, args.temperature)
        summary["http_offline_ratio"] = summary["output_throughput"] / summary["offline_output_throughput"]
    print(format_table(summary))
    return 0 if summary["failed_requests"] == 0 else 1
