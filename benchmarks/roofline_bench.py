"""Where SmolLM2-135M's steps sit on this machine's roofline: achieved bandwidth and FLOP/s of decode
steps at batch 1, 16 and 64 and of a large prefill, next to the peaks the start-up probe measured.

    .venv/bin/python benchmarks/roofline_bench.py [--dtypes bfloat16,float32] [--decode-tokens 32]

The numbers are the engine's own (`LLMEngine.roofline`, formulas in docs/metrics.md): each step's
bytes and FLOPs from the model and the step's shape, over the step's wall time.
"""

from __future__ import annotations

import argparse
import statistics

from pagoda.server.engine.llm import LLM
from pagoda.server.engine.sampling_params import SamplingParams


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list:
    steps = llm.engine.roofline.recording = []
    llm.engine.block_manager.reset_prefix_cache()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    llm.engine.roofline.recording = None
    return steps


def describe(label: str, steps: list) -> str:
    bps = statistics.median(s.bytes_per_s for s in steps)
    fps = statistics.median(s.flops_per_s for s in steps)
    peaks = steps[0].peaks
    intensity = statistics.median(s.intensity for s in steps)
    return (
        f"{label:<28} {len(steps):>4} steps  {bps / 1e9:7.2f} GB/s ({bps / peaks.bytes_per_s:6.1%})  "
        f"{fps / 1e9:7.2f} GFLOP/s ({fps / peaks.flops_per_s:6.1%})  {intensity:7.1f} FLOP/B  "
        f"{steps[0].bound if len(steps) == 1 else max(('memory', 'compute'), key=[s.bound for s in steps].count)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args()
    for dtype in args.dtypes.split(","):
        # dense weights: the roofline of the dtype, not of the GGUF's low-bit copies
        llm = LLM(dtype=dtype, device="cpu", quantization="none", kv_cache_memory=1 << 30, max_model_len=4096)
        peaks = llm.engine.roofline.peaks
        print(f"\n{dtype}: probe peaks {peaks.bytes_per_s / 1e9:.2f} GB/s, {peaks.flops_per_s / 1e9:.2f} GFLOP/s; "
              f"ridge {peaks.ridge_intensity:.1f} FLOP/B")  # fmt: skip
        prompt = [1 + (i * 7919) % 40000 for i in range(32)]
        for batch in (1, 16, 64):
            prompts = [[t + j for t in prompt] for j in range(batch)]
            steps = run(llm, prompts, args.decode_tokens)
            print(describe(f"decode, batch {batch}", [s for s in steps if s.tokens == batch]))
        long_prompt = [1 + (i * 104729) % 40000 for i in range(2047)]
        prefill = run(llm, [long_prompt], 1)[:1]
        print(describe("prefill, 2047 tokens", prefill))


if __name__ == "__main__":
    main()
