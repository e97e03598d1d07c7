"""Two builds of the native CPU kernels in one engine, step by step: where a kernel change pays.

The source of `kernels/cpu_native.c` at `--before REV` and the working tree's are both built and
loaded into one process; the engine runs a workload of `peer_serve.py` offline (c16 unless
`--workload` names another; its prompt sets in turn) and consecutive steps alternate between the two
libraries, so both see the same host moment, the same batch sizes and the same caches. Each step's
forward (`ModelRunner.run`) is timed and the report groups the steps by their rows: count, total and
median per build.

    .venv/bin/python benchmarks/kernel_ab.py --before HEAD~1 --model /path/to/SmolLM2-135M-Instruct --dtype float32

The embedded GGUF model is the default (`--model` unset). Whole-run throughput on this kind of
shared host moves by ±10 % between runs minutes apart; alternating steps cancels most of that.

`--attention` times the decode attention alone instead: SmolLM2's shape (9 query / 3 KV heads of 64)
or the ones `--heads` names (`32/8x128`: Llama 3 8B's), 30 layers of their own blocks for SmolLM2 (other
shapes as many layers as read the same bytes per token) in a cache too large for any CPU cache, 1-64
sequences of 100-8,000 tokens, both dtypes, the two builds taking turns, and tells whether they give the
same outputs bit for bit (a change in the order of the sums shows there).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

GROUPS = {"1": range(1, 2), "2-11": range(2, 12), "12-16": range(12, 17), "17-47": range(17, 48),
          "48-256": range(48, 257), "257+": range(257, 1 << 31)}  # fmt: skip


def load_both(before: str) -> dict:
    """{"before": library, "after": library}: the kernels at `before`, then the working tree's."""
    from pagoda.kernels import cpu_native

    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{before}:kernels/cpu_native.c"], capture_output=True, check=True
    ).stdout
    after_source = cpu_native.SOURCE
    with tempfile.TemporaryDirectory() as folder:
        cpu_native.SOURCE = Path(folder) / "cpu_native.c"
        cpu_native.SOURCE.write_bytes(source)
        try:
            old = cpu_native.library()
        except AttributeError as missing:  # an entry point this tree declares and that build lacks
            raise SystemExit(
                f"the kernels at {before} lack an entry point of this tree's: {missing}"
            ) from None
    cpu_native.SOURCE, cpu_native._library = after_source, cpu_native._NOT_BUILT
    new = cpu_native.library()
    if old is None or new is None:
        raise SystemExit("the native kernels did not build")
    return {"before": old, "after": new}


def median_ms(times: list[float]) -> float:
    return 1e3 * sorted(times)[len(times) // 2] if times else float("nan")


# sequences, tokens (one or two long contexts: the pieces the threads share)
ATTENTION_SHAPES = [(1, 256), (1, 2000), (1, 8000), (2, 1000), (16, 100), (16, 256), (16, 2000), (64, 256)]
# SmolLM2's 30 layers of 3 KV heads of 64: each shape gets as many layers as read its bytes per token
SMOLLM2_LAYERS, SMOLLM2_KV_WIDTH = 30, 3 * 64


def parse_heads(text: str) -> list[tuple[int, int, int]]:
    """Attention shapes from e.g. "9/3x64,32/8x128": query heads / KV heads x head size each."""
    shapes = []
    for item in text.split(","):
        heads, _, head_dim = item.partition("x")
        query_heads, _, kv_heads = heads.partition("/")
        shapes.append((int(query_heads), int(kv_heads), int(head_dim)))
    return shapes


def attention_ab(builds: dict, before: str, heads: list[tuple[int, int, int]], rounds: int = 8) -> None:
    import torch
    from pagoda.kernels import cpu_native

    generator = torch.Generator().manual_seed(0)
    print(f"decode attention, kernels at {before} (before) vs the working tree (after), medians")
    print(
        "| heads: query / KV x size | dtype | sequences x tokens | before ms | after ms | after / before | same |"
    )
    print("|---|---|---|---|---|---|---|")
    for num_heads, num_kv_heads, head_dim in heads:
        layers = max(1, round(SMOLLM2_LAYERS * SMOLLM2_KV_WIDTH / (num_kv_heads * head_dim)))
        label = f"{num_heads} / {num_kv_heads} x {head_dim}, {layers} layers"
        for dtype in (torch.bfloat16, torch.float32):
            for seqs, tokens in ATTENTION_SHAPES:
                width = tokens // 16 + 1
                num_blocks = seqs * width * layers
                k_cache, v_cache = (
                    torch.randn(num_blocks, 16, num_kv_heads, head_dim, generator=generator).to(dtype)
                    for _ in "kv"
                )
                blocks = torch.randperm(num_blocks, generator=generator).int().view(layers, seqs, width)
                lens = torch.full((seqs,), tokens, dtype=torch.int32)
                query = torch.randn(seqs, num_heads, head_dim, generator=generator).to(dtype)
                times, outputs = collections.defaultdict(list), {}
                for turn in range(rounds):
                    for name in ("before", "after") if turn % 2 else ("after", "before"):
                        cpu_native._library = builds[name]
                        started = time.perf_counter()
                        for table in blocks:
                            outputs[name] = cpu_native.paged_decode_attention(
                                query, k_cache, v_cache, table, lens, head_dim**-0.5, None
                            )
                        times[name].append(time.perf_counter() - started)
                old, new = median_ms(times["before"]), median_ms(times["after"])
                same = torch.equal(outputs["before"], outputs["after"])
                print(
                    f"| {label} | {str(dtype)[6:]} | {seqs} x {tokens} | {old:.2f} | {new:.2f} | {new / old:.2f}x "
                    f"| {same} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, metavar="REV", help="git revision of the other build")
    parser.add_argument("--model", help="an HF folder (default: the embedded GGUF model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=6, help="workload runs (prompt sets 0, 1, 2, 0, ...)")
    parser.add_argument("--workload", default="c16", help="a peer_serve workload by the start of its name")
    parser.add_argument("--attention", action="store_true", help="time the decode attention alone")
    parser.add_argument(
        "--heads", default="9/3x64", type=parse_heads,
        help="--attention's shapes: query heads / KV heads x head size, comma-separated (e.g. 32/8x128)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.attention:
        attention_ab(load_both(args.before), args.before, args.heads)
        return

    from pagoda.kernels import cpu_native
    from pagoda.server.bench.offline import OfflineBaseline
    from peer_serve import WORKLOADS

    workload = next((w for w in WORKLOADS if w.name.startswith(args.workload)), None)
    if workload is None:
        raise SystemExit(f"no workload {args.workload!r}: {', '.join(w.name for w in WORKLOADS)}")
    builds = load_both(args.before)
    baseline = OfflineBaseline(
        {"model": args.model, "dtype": args.dtype} if args.model else {"dtype": args.dtype}
    )
    runner = baseline.llm.engine.runner
    times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    run_step, steps_run = runner.run, [0]

    def alternating_run(step):
        name = ("before", "after")[steps_run[0] % 2]
        steps_run[0] += 1
        cpu_native._library = builds[name]
        started = time.perf_counter()
        result = run_step(step)
        times[(name, step.input_ids.shape[0])].append(time.perf_counter() - started)
        return result

    runner.run = alternating_run
    for run in range(args.runs):
        baseline.run(workload.requests(run % 3), max_concurrency=workload.concurrency)

    print(
        f"kernels at {args.before} (before) vs the working tree (after), {workload.name}, {args.runs} runs, "
        "steps alternated"
    )
    print("| rows | before: steps, s, median ms | after: steps, s, median ms | median after / before |")
    print("|---|---|---|---|")
    for label, rows in GROUPS.items():
        cells = []
        for name in builds:
            steps = [t for (which, n), ts in times.items() if which == name and n in rows for t in ts]
            cells.append((len(steps), sum(steps), median_ms(steps)))
        if cells[0][0] or cells[1][0]:
            ratio = cells[1][2] / cells[0][2] if cells[0][0] and cells[1][0] else float("nan")
            print(
                f"| {label} | "
                + " | ".join(f"{c}, {s:.2f}, {m:.1f}" for c, s, m in cells)
                + f" | {ratio:.2f} |"
            )


if __name__ == "__main__":
    main()
