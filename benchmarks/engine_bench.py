"""Engine benchmark: the PagedAttention paper's measurements on pagoda, against transformers, on this machine.

Sections (``--sections``, default all):
  memory      share of KV memory holding real tokens at peak (pagoda vs contiguous reservation baselines
              on the same trace), and block savings of n=4 sampling and beam width 4 vs no sharing
  throughput  output tok/s: pagoda offline vs transformers sequential generate, static (padded) batching
              and continuous batching (`generate_batch`'s manager); pagoda's step-time split
  prefix      time to first token for requests sharing a long system prompt, prefix cache on vs off

Prints a table per section and writes JSON (``--out``). Everything is fp32 on the default model
(SmolLM2-135M-Instruct) unless ``--model`` says otherwise; all counts scale down with flags.

    .venv/bin/python benchmarks/engine_bench.py                       # everything (~10-20 min on 2 cores)
    .venv/bin/python benchmarks/engine_bench.py --sections memory,prefix --num-requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from pagoda.server.engine.llm import LLM
from pagoda.server.engine.llm_engine import LLMEngine
from pagoda.server.engine.outputs import OutputCollector
from pagoda.server.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, also under PYTHONSAFEPATH
from bench_workload import Workload, log, make_workload, table
from transformers_baselines import hf_continuous, hf_sequential, hf_static


# ---- pagoda runs ---------------------------------------------------------------------------------------
def run_pagoda(engine: LLMEngine, prompts, params_list, on_step=None) -> dict:
    """Drive the engine step by step; returns timing totals (the model forward is timed by the runner)."""
    for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(f"b{i}", prompt, params)
    runner = engine.runner
    steps = []
    collected = OutputCollector()  # the engine hands out deltas
    outputs = {}
    started = time.perf_counter()
    while engine.has_unfinished():
        forward_before = runner.timings.forward_s
        t0 = time.perf_counter()
        num_decodes = sum(len(r.live_seqs()) for r in engine.scheduler.running)
        for request_id in collected.add(engine.step()):
            outputs[request_id] = collected[request_id]
        steps.append((time.perf_counter() - t0, runner.timings.forward_s - forward_before, num_decodes))
        if on_step is not None:
            on_step(engine)
    elapsed = time.perf_counter() - started
    return {"elapsed_s": elapsed, "steps": steps, "outputs": outputs}


def live_token_accounting(engine: LLMEngine) -> tuple[int, int, int, list[tuple[int, int]]]:
    """(blocks in use, tokens held in them, blocks if nothing were shared, per-request (tokens, reserve))."""
    held, unshared, per_request = 0, 0, []
    for request in engine.scheduler.running:
        tokens = 0
        for seq in request.live_seqs():
            tokens += seq.num_computed_tokens
            unshared += len(seq.block_table)
        held += tokens
        per_request.append((tokens, request.seqs[0].prompt_len + (request.params.max_tokens or 0)))
    return engine.block_manager.num_used_blocks, held, unshared, per_request


def trace_run(llm: LLM, args) -> tuple[Workload, dict, dict]:
    """The trace through pagoda once: timings for the throughput table, block peak for the memory one."""
    engine = llm.engine
    work = make_workload(args.num_requests, engine.vocab_size, args.seed)
    peak = {"blocks": -1}

    def on_step(engine):
        used, held, _, per_request = live_token_accounting(engine)
        if used > peak["blocks"]:
            peak.update(blocks=used, held=held, requests=per_request)

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in work.output_lens]
    forward_before = llm.engine.runner.timings.forward_s
    run = run_pagoda(engine, work.prompts, params, on_step)
    run["forward_s"] = llm.engine.runner.timings.forward_s - forward_before
    return work, run, peak


def memory_section(llm: LLM, work: Workload, peak: dict, args, results: dict) -> str:
    engine = llm.engine
    bs = engine.block_manager.block_size
    reserve_max = max(p + o for p, o in zip(map(len, work.prompts), work.output_lens, strict=True))
    held = peak["held"]
    pagoda_share = held / (peak["blocks"] * bs)
    max_share = held / (len(peak["requests"]) * reserve_max)
    oracle_share = held / sum(reserve for _, reserve in peak["requests"])
    rows = [
        [f"pagoda (blocks of {bs})", peak["blocks"] * bs, held, 100 * pagoda_share],
        [
            f"contiguous, reserve max length ({reserve_max})",
            len(peak["requests"]) * reserve_max,
            held,
            100 * max_share,
        ],
        [
            "contiguous, reserve prompt + own max_tokens (oracle)",
            sum(r for _, r in peak["requests"]),
            held,
            100 * oracle_share,
        ],
    ]
    out = table(
        f"Memory: KV slots at pagoda's peak ({args.num_requests} requests, prompt 16-512, output 8-512 long-tailed)",
        ["system", "slots reserved", "tokens held", "% real tokens"],
        rows,
    )
    results["memory"] = {
        "num_requests": args.num_requests,
        "block_size": bs,
        "peak_blocks": peak["blocks"],
        "tokens_held_at_peak": held,
        "running_at_peak": len(peak["requests"]),
        "pagoda_real_token_share": pagoda_share,
        "contiguous_max_length": reserve_max,
        "contiguous_max_real_token_share": max_share,
        "contiguous_oracle_real_token_share": oracle_share,
    }
    sharing_rows = []
    for name, params in (
        (
            "parallel sampling n=4",
            SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=args.sharing_tokens, ignore_eos=True),
        ),
        (
            "beam search width 4",
            SamplingParams(
                use_beam_search=True,
                best_of=4,
                temperature=0.0,
                max_tokens=args.sharing_tokens,
                ignore_eos=True,
            ),
        ),
    ):
        totals = {"used": 0, "unshared": 0, "peak_used": 0, "peak_unshared": 0}

        def on_sharing_step(engine, totals=totals):
            used, _, unshared, _ = live_token_accounting(engine)
            totals["used"] += used
            totals["unshared"] += unshared
            totals["peak_used"] = max(totals["peak_used"], used)
            totals["peak_unshared"] = max(totals["peak_unshared"], unshared)

        prompts = work.prompts[: args.sharing_requests]
        run_pagoda(engine, prompts, [params] * len(prompts), on_sharing_step)
        saving = 1 - totals["used"] / totals["unshared"]
        peak_saving = 1 - totals["peak_used"] / totals["peak_unshared"]
        sharing_rows.append(
            [name, totals["peak_unshared"], totals["peak_used"], 100 * peak_saving, 100 * saving]
        )
        results["memory"][name] = {
            "requests": len(prompts),
            "max_tokens": args.sharing_tokens,
            "peak_blocks_unshared": totals["peak_unshared"],
            "peak_blocks_used": totals["peak_used"],
            "peak_saving": peak_saving,
            "time_averaged_saving": saving,
        }
    out += table(
        f"Memory: block sharing ({args.sharing_requests} prompts of the trace, {args.sharing_tokens} output tokens)",
        [
            "workload",
            "peak blocks, no sharing",
            "peak blocks, pagoda",
            "% saved at peak",
            "% saved (time avg)",
        ],
        sharing_rows,
    )
    return out


# ---- throughput -----------------------------------------------------------------------------------------
def step_split(steps, min_decodes: int) -> tuple[float, int]:
    chosen = [(total, fwd) for total, fwd, decodes in steps if decodes >= min_decodes]
    if not chosen:
        return float("nan"), 0
    total = sum(t for t, _ in chosen)
    return 1 - sum(f for _, f in chosen) / total, len(chosen)


def throughput_section(llm: LLM, work: Workload, run: dict, hf_model, args, results: dict) -> str:
    engine = llm.engine
    produced = sum(len(o.outputs[0].token_ids) for o in run["outputs"].values())
    assert produced == work.num_output_tokens
    pagoda_tps = produced / run["elapsed_s"]
    rest_all = 1 - run["forward_s"] / sum(s[0] for s in run["steps"])
    # Steady decode at batch 64: identical short prompts, everyone decoding every step.
    batch = args.split_batch
    steady = run_pagoda(
        engine,
        [work.prompts[0][:16]] * batch,
        [SamplingParams(temperature=0.0, max_tokens=args.split_tokens, ignore_eos=True)] * batch,
    )
    rest_64, n_steps = step_split(steady["steps"], batch)
    log(f"pagoda: {run['elapsed_s']:.1f}s for the trace; steady batch-{batch} decode measured")
    rows = [["pagoda (offline engine)", produced, run["elapsed_s"], pagoda_tps, ""]]
    modes = {}
    if hf_model is not None:
        pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
        limit = min(args.hf_sequential_requests, len(work.prompts))
        log(f"transformers sequential generate ({limit} requests) ...")
        seconds, tokens = hf_sequential(hf_model, work, limit)
        note = f"first {limit} requests" if limit < len(work.prompts) else ""
        modes["transformers sequential generate"] = (tokens, seconds, note)
        log("transformers static batching ...")
        seconds, tokens = hf_static(hf_model, work, args.static_batch_size, pad_id)
        modes[f"transformers static batching (padded, batch {args.static_batch_size})"] = (
            tokens,
            seconds,
            "useful tokens",
        )
        try:
            log("transformers continuous batching ...")
            kv_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
            seconds, tokens = hf_continuous(hf_model, work, kv_tokens)
            modes["transformers continuous batching"] = (tokens, seconds, "")
        except Exception as exc:  # report, do not hide: the table says it failed
            modes["transformers continuous batching"] = (
                0,
                float("nan"),
                f"failed: {type(exc).__name__}: {exc}"[:120],
            )
    best = max((t / s for t, s, _ in modes.values() if s == s and s > 0), default=float("nan"))
    for name, (tokens, seconds, note) in modes.items():
        rows.append(
            [
                name,
                tokens,
                seconds,
                tokens / seconds if seconds == seconds and seconds > 0 else float("nan"),
                note,
            ]
        )
    out = table(
        f"Throughput: {len(work.prompts)} requests, {work.num_output_tokens} output tokens, fp32, "
        f"{torch.get_num_threads()} threads",
        ["system", "output tokens", "seconds", "output tok/s", "note"],
        rows,
    )
    ratio = pagoda_tps / best if best == best else float("nan")
    out += f"\n\npagoda / best transformers mode: {ratio:.2f}x"
    out += (
        f"\npagoda step time outside the model forward: {100 * rest_all:.1f}% over the whole run; "
        f"{100 * rest_64:.1f}% at batch {batch} ({n_steps} steady decode steps)"
    )
    results["throughput"] = {
        "num_requests": len(work.prompts),
        "output_tokens": work.num_output_tokens,
        "pagoda": {"seconds": run["elapsed_s"], "tokens_per_s": pagoda_tps, "steps": len(run["steps"])},
        "transformers": {
            name: {"tokens": t, "seconds": s, "tokens_per_s": t / s if s == s and s > 0 else None, "note": n}
            for name, (t, s, n) in modes.items()
        },
        "ratio_vs_best_transformers": ratio,
        "rest_share_whole_run": rest_all,
        "rest_share_at_batch": {"batch": batch, "share": rest_64, "steps": n_steps},
    }
    return out


# ---- prefix caching --------------------------------------------------------------------------------------
def prefix_section(llm_on: LLM, llm_off: LLM, args, results: dict) -> str:
    rng = np.random.default_rng(args.seed + 1)
    vocab = llm_on.engine.vocab_size
    system = rng.integers(100, vocab - 100, size=args.prefix_len).tolist()
    prompts = [
        system + rng.integers(100, vocab - 100, size=int(rng.integers(8, 32))).tolist()
        for _ in range(args.prefix_requests)
    ]
    rows, data = [], {}
    runs = (
        ("prefix cache off", llm_off, True),
        ("prefix cache on, cold", llm_on, True),
        ("prefix cache on, warm", llm_on, False),
    )
    for name, llm, cold in runs:  # warm: the same requests again, the system prompt already cached
        if cold:
            llm.engine.block_manager.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
        cached = sum(o.num_cached_tokens for o in outputs)
        rows.append([name, statistics.mean(ttft), statistics.median(ttft), max(ttft), cached, elapsed])
        data[name] = {
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_p50_s": statistics.median(ttft),
            "ttft_max_s": max(ttft),
            "cached_prompt_tokens": cached,
            "total_s": elapsed,
        }
    results["prefix"] = {"requests": args.prefix_requests, "system_prompt_tokens": args.prefix_len, **data}
    return table(
        f"Prefix caching: {args.prefix_requests} requests sharing a {args.prefix_len}-token system prompt "
        "(all submitted at once)",
        ["mode", "TTFT mean s", "TTFT p50 s", "TTFT max s", "cached prompt tokens", "all done s"],
        rows,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--sections", default="memory,throughput,prefix")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharing-requests", type=int, default=8)
    parser.add_argument("--sharing-tokens", type=int, default=64)
    parser.add_argument(
        "--hf-sequential-requests",
        type=int,
        default=16,
        help="sequential generate runs this many (rate extrapolates)",
    )
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--split-batch", type=int, default=64)
    parser.add_argument("--split-tokens", type=int, default=32)
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every system (1 by default: on a shared 2-core machine, 2 OpenMP threads "
        "under oversubscription make each small matmul tens of times slower)",
    )
    parser.add_argument("--out", default=str(Path(__file__).with_name("engine_bench_results.json")))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    from pagoda.server.engine.config import parse_bytes
    from pagoda.server.engine.loader import load_model, resolve_model_source

    sections = set(args.sections.split(","))
    source = resolve_model_source(args.model)
    loaded = load_model(source, dtype="float32", device="cpu")
    kv = parse_bytes(args.kv_cache_memory)
    llm = LLM(loaded=loaded, device="cpu", kv_cache_memory=kv, max_num_seqs=256)
    results: dict = {
        "model": loaded.name,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
    }
    report = [f"# pagoda engine benchmark — {loaded.name}, fp32, CPU, {torch.get_num_threads()} threads"]
    if sections & {"memory", "throughput"}:
        log(f"pagoda: {args.num_requests}-request trace ...")
        work, run, peak = trace_run(llm, args)
    if "memory" in sections:
        report.append(memory_section(llm, work, peak, args, results))
        print(report[-1], flush=True)
    if "throughput" in sections:
        hf_model = None
        if not args.no_transformers:
            from transformers import AutoModelForCausalLM

            if source.kind == "gguf":
                hf_model = AutoModelForCausalLM.from_pretrained(
                    source.path.parent, gguf_file=source.path.name, dtype=torch.float32
                )
            else:
                hf_model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
            hf_model.eval()
        report.append(throughput_section(llm, work, run, hf_model, args, results))
        print(report[-1], flush=True)
    if "prefix" in sections:
        llm_off = LLM(loaded=loaded, device="cpu", kv_cache_memory=kv, enable_prefix_caching=False)
        report.append(prefix_section(llm, llm_off, args, results))
        print(report[-1], flush=True)
    results["load_average_at_end"] = os.getloadavg()
    report.append(
        f"\nload average (1/5/15 min) at start {results['load_average_at_start']}, at end {results['load_average_at_end']}"
    )
    print(report[-1])
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"\nJSON: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
