"""What bf16 and low-bit weights cost in accuracy, on 100 prompts of the embedded SmolLM2.

    .venv/bin/python benchmarks/accuracy.py [--prompts 100] [--tokens 32]   # ~10 min here

Greedy continuations of each prompt from:
- pagoda fp32 on the dequantized weights (the reference: equal to transformers fp32, tests/models);
- pagoda bf16 on the dequantized weights (`--quantization none`);
- pagoda bf16 with the GGUF's low-bit weights (the default on this CPU), one prompt at a time so every
  decode step has one row and takes the low-bit path;
- pagoda bf16 with 4-bit copies made at load from the dense weights (`--quantization int4`, as an HF
  folder gets them), one prompt at a time. These weights came from a Q4_1 file whose blocks are the
  same groups of 32: the 4-bit grid fits them closer than it fits weights trained in bf16;
- transformers bf16 (`generate`, eager) on the same (dequantized) weights.
For each pair: the share of prompts whose continuation is identical, the mean number of tokens before
the first difference, and the mean |difference| of the chosen tokens' logprobs where both agree.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

SUBJECTS = ["the ocean", "a small robot", "the history of Rome", "photosynthesis", "a rainy day", "chess"]
FORMS = [
    "Write one sentence about {}.",
    "Explain {} to a child.",
    "List three facts about {}:",
    "The most surprising thing about {} is",
    "Q: What do you know about {}?\nA:",
]


def prompts(count: int) -> list[str]:
    rng = random.Random(0)
    return [rng.choice(FORMS).format(rng.choice(SUBJECTS) + f" ({i})") for i in range(count)]


def pagoda_runs(texts: list[str], tokens: int, dtype: str, quantization: str, one_at_a_time: bool):
    from pagoda import LLM, SamplingParams

    llm = LLM(dtype=dtype, quantization=quantization)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = [llm.generate([t], params)[0] for t in texts] if one_at_a_time else llm.generate(texts, params)
    runs = []
    for out in outputs:
        choice = out.outputs[0]
        logprobs = [entry[token] for entry, token in zip(choice.logprobs, choice.token_ids, strict=True)]
        runs.append((list(out.prompt_token_ids), choice.token_ids, logprobs))
    return runs


@torch.inference_mode()
def transformers_runs(prompt_ids: list[list[int]], tokens: int):
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from peer_serve import ROOT, hf_folder_from_gguf

    # The dequantized HF folder: transformers' GGUF loading keeps the weights packed, which is not the
    # dense bf16 model compared here.
    folder = hf_folder_from_gguf(ROOT / "benchmarks" / "results" / "peer_serve" / "SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    runs = []
    for ids in prompt_ids:
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[0, len(ids) :].tolist()
        logprobs = [
            torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, new, strict=True)
        ]
        runs.append((ids, new, logprobs))
    return runs


def compare(a, b) -> dict:
    identical, prefix, deltas = 0, [], []
    for (_, ta, la), (_, tb, lb) in zip(a, b, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        identical += first == len(ta)
        prefix.append(first)
        deltas += [abs(x - y) for x, y in zip(la[:first], lb[:first], strict=True)]
    return {
        "identical_share": identical / len(a),
        "mean_tokens_before_first_difference": statistics.fmean(prefix),
        "mean_abs_logprob_diff": statistics.fmean(deltas) if deltas else 0.0,
        "max_abs_logprob_diff": max(deltas) if deltas else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", help="write the table as JSON")
    args = parser.parse_args()
    texts = prompts(args.prompts)
    runs = {
        "pagoda fp32": pagoda_runs(texts, args.tokens, "float32", "none", one_at_a_time=False),
        "pagoda bf16": pagoda_runs(texts, args.tokens, "bfloat16", "none", one_at_a_time=False),
        "pagoda bf16 + GGUF low-bit": pagoda_runs(texts, args.tokens, "bfloat16", "gguf", one_at_a_time=True),
        "pagoda bf16 + int4": pagoda_runs(texts, args.tokens, "bfloat16", "int4", one_at_a_time=True),
    }
    runs["transformers bf16"] = transformers_runs([ids for ids, _, _ in runs["pagoda fp32"]], args.tokens)
    pairs = [
        ("pagoda bf16", "pagoda fp32"),
        ("transformers bf16", "pagoda fp32"),
        ("pagoda bf16", "transformers bf16"),
        ("pagoda bf16 + GGUF low-bit", "pagoda bf16"),
        ("pagoda bf16 + GGUF low-bit", "pagoda fp32"),
        ("pagoda bf16 + int4", "pagoda bf16"),
        ("pagoda bf16 + int4", "pagoda bf16 + GGUF low-bit"),
    ]
    table = {f"{a} vs {b}": compare(runs[a], runs[b]) for a, b in pairs}
    print(f"{args.prompts} prompts x {args.tokens} greedy tokens")
    print("| pair | identical continuations | tokens before first difference | mean / max abs logprob diff |")
    print("|---|---|---|---|")
    for name, row in table.items():
        print(
            f"| {name} | {row['identical_share']:.0%} | {row['mean_tokens_before_first_difference']:.1f} | "
            f"{row['mean_abs_logprob_diff']:.3f} / {row['max_abs_logprob_diff']:.3f} |"
        )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(table, handle, indent=1)


if __name__ == "__main__":
    main()
