"""The engine benchmark's workload (random prompts, long-tailed output lengths) and its printing."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, vocab: int, seed: int, prompt_range=(16, 512), output_range=(8, 512)) -> Workload:
    """Uniform prompt lengths; long-tailed (log-normal, median 48) output lengths, clipped to the range."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    outputs = np.clip(np.round(np.exp(rng.normal(math.log(48), 1.0, size=n))), *output_range).astype(int)
    prompts = [rng.integers(100, vocab - 100, size=int(length)).tolist() for length in prompt_lens]
    return Workload(prompts, outputs.tolist())


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[f"{c:,.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [f"\n## {title}", " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells[1:]]
    return "\n".join(lines)
