"""The native CPU kernels against torch's, on SmolLM2-135M's shapes, in one run (~3 min here).

    .venv/bin/python benchmarks/cpu_native_bench.py

1. Decode attention of one layer (9 query / 3 KV heads, head_dim 64, 16-token blocks): the CPU
   backend with torch's fused attention vs its native kernel, median µs per call.
2. Every projection of the model once (30 layers of distinct weights + the LM head, as one decode
   step reads them): torch's GEMM vs the native few-row kernels, ms and GB/s of weights read.
3. The layers' projections in 4 bits (GGUF Q4 groups of 32, the native kernel) against the dense
   bf16 kernels, at 1-4 rows, and the LM head's int8 copy against its bf16 weight: where the low-bit
   copies stop paying (`FEW_ROWS`, server/engine/layers/quantized.py).
4. The engine's decode step on the embedded model (dense weights, 60-token prompts, greedy), each in its own
   process: PAGODA_NATIVE_KERNELS=0 vs on, median ms of the model step.
Both dtypes; nothing else should run on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from pagoda.kernels import cpu_native
from pagoda.kernels.cpu_backend import CpuBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_bandwidth import dram_read_gbps

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate+up, down
HEAD = (49152, 576)


def median_s(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def attention_rows(dtype: torch.dtype) -> list[str]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for seqs, context in ((1, 100), (1, 2000), (16, 100), (16, 300), (64, 100)):
        k_cache = torch.randn(4000, 16, 3, 64, generator=generator).to(dtype)
        v_cache = torch.randn(4000, 16, 3, 64, generator=generator).to(dtype)
        lens = torch.randint(context // 2, context * 3 // 2, (seqs,), generator=generator, dtype=torch.int32)
        width = -(-int(lens.max()) // 16)
        tables = torch.randperm(4000, generator=generator)[: seqs * width].view(seqs, width).int()
        query = torch.randn(seqs, 9, 64, generator=generator).to(dtype)
        args = (query, k_cache, v_cache, tables, lens, 0.125, None)
        fused = median_s(lambda a=args: CpuBackend(native=False).paged_decode_attention(*a, step_cache={}), 50)
        native = median_s(lambda a=args: cpu_native.paged_decode_attention(*a), 50)
        rows.append(
            f"| {dtype_name(dtype)} | {seqs} x ~{context} | {fused * 1e6:.0f} | {native * 1e6:.0f} | {fused / native:.2f}x |"
        )
    return rows


def projection_rows(dtype: torch.dtype) -> list[str]:
    weights = [torch.randn(*shape, dtype=dtype) for _ in range(30) for shape in SHAPES]
    weights.append(torch.randn(*HEAD, dtype=dtype))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    rows = []
    for num_rows in (1, 4, 16):
        inputs = {k: torch.randn(num_rows, k, dtype=dtype) for k in (576, 1536)}
        pairs = [(inputs[w.shape[1]], w) for w in weights]
        taken = cpu_native.linear(pairs[0][0], pairs[0][1], None) is not None
        torch_s = median_s(lambda p=pairs: [F.linear(x, w) for x, w in p], 7)
        native_s = median_s(lambda p=pairs: [cpu_native.linear(x, w, None) for x, w in p], 7) if taken else None
        native = f"{native_s * 1e3:.1f} ({nbytes / native_s / 1e9:.1f} GB/s)" if native_s else "torch's (not taken)"
        ratio = f"{torch_s / native_s:.2f}x" if native_s else "-"
        rows.append(
            f"| {dtype_name(dtype)} | {num_rows} | {torch_s * 1e3:.1f} ({nbytes / torch_s / 1e9:.1f} GB/s) | {native} | {ratio} |"
        )
    return rows


def low_bit_rows() -> list[str]:
    from pagoda.server.engine.layers.linear import project
    from pagoda.server.engine.layers.quantized import Int4Weight, Int8Weight

    generator = torch.Generator().manual_seed(0)
    dense = [torch.randn(*shape, generator=generator).to(torch.bfloat16) for _ in range(30) for shape in SHAPES]
    low_bit = []
    for weight in dense:
        out_features, in_features = weight.shape
        q = torch.randint(0, 16, (out_features, in_features), generator=generator)
        scales, zeros = torch.rand(out_features, in_features // 32) / 100, torch.randn(out_features, in_features // 32) / 100
        low_bit.append(Int4Weight(q, scales, zeros, torch.bfloat16))
    head = torch.randn(*HEAD, generator=generator).to(torch.bfloat16)
    head_int8 = Int8Weight(head, torch.bfloat16)
    rows = []
    for num_rows in (1, 2, 3, 4):
        inputs = {k: torch.randn(num_rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
        dense_s = median_s(lambda x=inputs: [project(x[w.shape[1]], w, None, None) for w in dense], 7)
        int4_s = median_s(lambda x=inputs: [q.matmul(x[q.in_features], None) for q in low_bit], 7)
        head_s = median_s(lambda x=inputs: project(x[576], head, None, None), 7)
        int8_s = median_s(lambda x=inputs: head_int8.matmul(x[576], None), 7)
        rows.append(
            f"| {num_rows} | {dense_s * 1e3:.1f} | {int4_s * 1e3:.1f} ({dense_s / int4_s:.2f}x) | "
            f"{head_s * 1e3:.2f} | {int8_s * 1e3:.2f} ({head_s / int8_s:.2f}x) |"
        )
    return rows


STEP_PROBE = """
import json, random, sys, time
from pagoda.server.engine.llm import LLM
from pagoda.server.engine.sampling_params import SamplingParams
llm = LLM(dtype=sys.argv[1], quantization="none")  # the dense path both ways
engine, runner = llm.engine, llm.engine.runner
times, run = [], runner.run
def timed(step):
    start = time.perf_counter(); out = run(step); times.append(time.perf_counter() - start); return out
runner.run = timed
random.seed(0)
result = {}
for rows in (1, 16):
    for i in range(rows):
        prompt = [random.randrange(1000, 20000) for _ in range(60)]
        engine.add_request(f"{rows}-{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    engine.step(); engine.step(); times.clear()
    for _ in range(30): engine.step()
    result[rows] = sorted(times)[len(times) // 2]
    while engine.has_unfinished(): engine.step()
print(json.dumps(result))
"""


def engine_rows(dtype: torch.dtype) -> list[str]:
    measured = {}
    for native in ("0", "1"):
        env = {**os.environ, "PAGODA_NATIVE_KERNELS": native}
        out = subprocess.run(
            [sys.executable, "-c", STEP_PROBE, dtype_name(dtype)], env=env, capture_output=True, text=True, check=True
        )
        measured[native] = json.loads(out.stdout.strip().splitlines()[-1])
    return [
        f"| {dtype_name(dtype)} | {rows} | {measured['0'][rows] * 1e3:.1f} | {measured['1'][rows] * 1e3:.1f} | "
        f"{measured['0'][rows] / measured['1'][rows]:.2f}x |"
        for rows in ("1", "16")
    ]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> None:
    if cpu_native.library() is None:
        sys.exit("the native kernels do not build here (no C compiler?)")
    print(f"threads {torch.get_num_threads()}, AMX {bool(cpu_native.library().amx)}, DRAM read {dram_read_gbps():.1f} GB/s\n")
    print("| dtype | sequences x context | torch fused µs | native µs | speed-up |\n|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        print("\n".join(attention_rows(dtype)))
    print("\n| dtype | rows | torch ms | native ms | speed-up |\n|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        print("\n".join(projection_rows(dtype)))
    print("\n| rows | layers bf16 ms | layers int4 ms | LM head bf16 ms | LM head int8 ms |\n|---|---|---|---|---|")
    print("\n".join(low_bit_rows()))
    print("\n| dtype | decode rows | step ms, torch only | step ms, native | speed-up |\n|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        print("\n".join(engine_rows(dtype)))


if __name__ == "__main__":
    main()
