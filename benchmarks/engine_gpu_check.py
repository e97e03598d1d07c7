"""The engine's own checks on a GPU: greedy tokens on the Triton path equal the torch reference path's,
and the median decode step of a random-weight 1B-class Llama (plus the KV pool a server would size).

The kernels alone are `kernels/bench.py` (run first when a GPU is lent); this is the engine on top:

    python benchmarks/engine_gpu_check.py --out OUT_DIR     # engine_check.json and engine_check.md

`tests/kernels/test_kernels_engine_gpu_check.py` runs every path of it on the CPU at tiny sizes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]  # the one random-model builder: tests/support/tiny_models.py

from pagoda.server.engine.block_manager import blocks_for_tokens  # noqa: E402
from pagoda.server.engine.config import EngineArgs  # noqa: E402
from pagoda.server.engine.llm import LLM  # noqa: E402
from pagoda.server.engine.llm_engine import LLMEngine  # noqa: E402
from pagoda.server.engine.loader import load_model  # noqa: E402
from pagoda.server.engine.sampling_params import SamplingParams  # noqa: E402
from support.tiny_models import make_random_llama  # noqa: E402

BLOCK_SIZE = 16

# LlamaConfig fields: (hidden, intermediate, layers, heads, kv heads, vocab, max positions).
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings")  # fmt: skip
# One 1B-class Llama (Llama-3.2-1B's shape) for the engine decode step.
ENGINE_MODEL = {**dict(zip(SHAPE_FIELDS, (2048, 8192, 16, 32, 8, 128256, 8192), strict=True)),
                "tie_word_embeddings": True}  # fmt: skip
ENGINE_BATCHES = (1, 32, 128)
# A small Llama for the engine's Triton-vs-torch greedy check (GQA 4, head_dim 64).
CHECK_MODEL = dict(zip(SHAPE_FIELDS, (512, 1024, 4, 8, 2, 1024, 1024), strict=True))
CHECK_TOKENS = 16
ENGINE_PROMPT, ENGINE_STEPS = 512, 32


# The engine paths compared on the device: the op-by-op reference, the Triton kernels launched step by
# step, and the Triton kernels with decode steps replayed from CUDA graphs (the default on CUDA).
GREEDY_PATHS = {
    "torch": dict(attention_backend="torch", enforce_eager=True),
    "triton, eager": dict(attention_backend="triton", enforce_eager=True),
    "triton, CUDA graphs": dict(attention_backend="triton"),
}


def check_engine_greedy(report: Report, device) -> None:
    """The engine end to end on the device: greedy tokens of the Triton path, eager and from CUDA graphs,
    equal the torch path's (fp32, a small random Llama; chunked prefill and a prefix-cache hit included)."""
    generator = torch.Generator().manual_seed(1)

    def random_ids(n: int) -> list[int]:
        return torch.randint(3, CHECK_MODEL["vocab_size"], (n,), generator=generator).tolist()

    shared = random_ids(40)
    prompts = [shared + random_ids(n) for n in (1, 7, 33, 90)] + [random_ids(5), random_ids(200)]
    params = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    tokens = {}
    with tempfile.TemporaryDirectory() as folder:
        make_random_llama(Path(folder), device, CHECK_MODEL, torch.float32)
        for path, engine_args in GREEDY_PATHS.items():
            loaded = load_model(folder, dtype="float32", device=device)
            llm = LLM(loaded=loaded, device=str(device), block_size=BLOCK_SIZE, max_num_batched_tokens=64,
                      num_blocks=256, max_num_seqs=8, **engine_args)  # fmt: skip
            llm.generate(prompts[:1], params)  # caches the shared prefix for the others
            tokens[path] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
            del llm, loaded
    for path, against in (("triton, eager", "torch"), ("triton, CUDA graphs", "triton, eager")):
        differing = sum(a != b for a, b in zip(tokens[against], tokens[path], strict=True))
        report.checks.append(
            {
                "kernel": "engine",
                "case": f"greedy tokens, {path} vs {against} (fp32, {len(prompts)} prompts x {CHECK_TOKENS})",
                "rel_err": differing / len(prompts),  # the share of prompts whose tokens differ
                "ok": differing == 0,
            }
        )


def time_engine_decode(report: Report, device) -> None:
    """Median engine step time once every sequence is decoding, on a random-weight 1B-class Llama."""

    with tempfile.TemporaryDirectory() as folder:
        make_random_llama(Path(folder), device, ENGINE_MODEL)
        loaded = load_model(folder, dtype="bfloat16", device=device)
        # The pool sizing a server does at start (on CUDA: a profiling forward of a full step).
        sized = LLMEngine(
            EngineArgs(model=folder, dtype="bfloat16", device=str(device), gpu_memory_utilization=0.5,
                       kv_cache_memory=64 << 20, seed=0),
            loaded=loaded,
        )  # fmt: skip
        pool = sized.block_manager
        report.notes.append(
            f"engine KV pool sized at gpu_memory_utilization 0.5: {pool.num_blocks} blocks of "
            f"{pool.block_size} tokens ({pool.num_blocks * pool.block_size} tokens, "
            f"{pool.num_blocks * sized.spec.bytes_per_block / 2**30:.2f} GiB)"
        )
        if sized.runner.graphs is not None:
            graphs = sized.runner.graphs
            report.notes.append(
                f"decode CUDA graphs at the default max_num_seqs: {len(graphs.sizes)} batch sizes up to "
                f"{graphs.sizes[-1]}, captured in {graphs.capture_seconds:.1f} s"
            )
        del sized, pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for batch, graphs in itertools.product(ENGINE_BATCHES, (True, False)):
            blocks = batch * blocks_for_tokens(ENGINE_PROMPT + ENGINE_STEPS + 1, BLOCK_SIZE) + 8
            engine = LLMEngine(
                EngineArgs(
                    model=folder,
                    dtype="bfloat16",
                    device=str(device),
                    block_size=BLOCK_SIZE,
                    max_num_seqs=batch,
                    num_blocks=blocks,
                    enable_prefix_caching=False,
                    enforce_eager=not graphs,
                    seed=0,
                ),
                loaded=loaded,
            )
            captured = engine.runner.graphs
            params = SamplingParams(max_tokens=ENGINE_STEPS, temperature=0.0, ignore_eos=True)
            prompt_gen = torch.Generator().manual_seed(batch)
            for i in range(batch):
                prompt = torch.randint(engine.vocab_size, (ENGINE_PROMPT,), generator=prompt_gen).tolist()
                engine.add_request(f"bench-{i}", prompt, params)
            produced: dict[str, int] = {}
            step_seconds = []
            while engine.has_unfinished():
                decoding = len(produced) == batch and all(n >= 1 for n in produced.values())
                start = time.perf_counter()
                outputs = engine.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if decoding:
                    step_seconds.append(time.perf_counter() - start)
                for output in outputs:
                    produced[output.request_id] = len(output.outputs[0].token_ids)
            step_seconds.sort()
            median = step_seconds[len(step_seconds) // 2] if step_seconds else float("nan")
            report.engine.append(
                {
                    "batch": batch,
                    "mode": "CUDA graphs" if graphs else "eager",
                    "capture_s": captured.capture_seconds if captured else None,
                    "context": ENGINE_PROMPT,
                    "decode_steps": len(step_seconds),
                    "step_ms": median * 1e3,
                    "tokens_per_s": batch / median,
                }
            )
            del engine
            torch.cuda.empty_cache()


@dataclass
class Report:
    device: str
    checks: list = field(default_factory=list)
    engine: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check["ok"] for check in self.checks)


def run(report: Report, device: torch.device) -> None:
    check_engine_greedy(report, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    time_engine_decode(report, device)


def markdown(report: Report) -> str:
    lines = [f"Device: {report.device}", "", "| check | case | share differing | ok |", "|---|---|---|---|"]
    lines += [f"| {c['kernel']} | {c['case']} | {c['rel_err']:.2f} | {'yes' if c['ok'] else '**NO**'} |"
              for c in report.checks]
    if report.engine:
        lines += ["", "| engine decode step | mode | context | median ms | tokens/s | capture s |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for e in report.engine:
            capture = "" if e["capture_s"] is None else f"{e['capture_s']:.1f}"
            lines.append(f"| batch {e['batch']} | {e['mode']} | {e['context']} | {e['step_ms']:.2f} | "
                         f"{e['tokens_per_s']:.0f} | {capture} |")  # fmt: skip
    lines += [""] + [f"- {note}" for note in report.notes]
    return "\n".join(lines)


def write_report(report: Report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_check.json").write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=2))
    (out / "engine_check.md").write_text(markdown(report) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for engine_check.json/.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device (tests/kernels/test_kernels_engine_gpu_check.py runs it on the CPU at tiny sizes)")
    device = torch.device("cuda")
    report = Report(device=torch.cuda.get_device_name(device))
    try:
        run(report, device)
    except Exception:  # a one-shot GPU run still leaves what it measured, and why it stopped
        report.notes.append("CRASHED:\n```\n" + traceback.format_exc() + "```")
        report.checks.append({"kernel": "engine", "case": "crashed (see notes)", "rel_err": float("nan"), "ok": False})
    write_report(report, args.out)
    print(markdown(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
