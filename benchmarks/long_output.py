"""Per-step engine overhead over one long output: does a step cost more as the output grows?

Runs the engine of each given source tree in a subprocess of its own (the tree's `pagoda` package,
not the installed one) on the same tiny random Llama (a transformers config, built once), one
request of `--n` sequences (seeded sampling), ignore_eos, `--max-tokens` 4096 each, logprobs on. Each step is timed from the call of
`LLMEngine.step()` until its outputs are joined into the whole output (what `LLM.generate` does),
and split into the model forward (`ModelRunner.execute`) and the rest: the engine's overhead. It
reports the 10th percentile and the median of the overhead per step over the first and the last
`--window` decode steps; the forward grows with the context (attention reads it all), the overhead
should not.

    .venv/bin/python benchmarks/long_output.py --before HEAD~1     # a worktree of HEAD~1 vs this tree
    .venv/bin/python benchmarks/long_output.py --tree old=/path/to/checkout --tree new=.

Single steps on a shared machine are noisy (the 10th percentile less so): compare the last/first
ratios, and run twice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
# The folders the distribution installs under `pagoda.` (pyproject.toml's package-dir).
PACKAGE_DIRS = {"server": "server", "kernels": "kernels", "operator": "operator"}


def child(model: str, max_tokens: int, window: int, n: int) -> dict:
    """In the tree's own interpreter path: one long request, each step timed."""
    import time

    from pagoda.server.engine import outputs as outputs_module
    from pagoda.server.engine.config import EngineArgs
    from pagoda.server.engine.llm_engine import LLMEngine
    from pagoda.server.engine.sampling_params import SamplingParams

    max_len = len(PROMPT) + max_tokens + 16
    engine = LLMEngine(EngineArgs(model=model, device="cpu", dtype="float32", cpu_threads=1, block_size=16,
                                  num_blocks=n * (max_len // 16 + 2), max_model_len=max_len,
                                  enable_prefix_caching=False))  # fmt: skip
    forward: list[float] = []
    execute = engine.runner.execute

    def timed_execute(out):
        started = time.perf_counter()
        result = execute(out)
        forward.append(time.perf_counter() - started)
        return result

    engine.runner.execute = timed_execute
    # The output path: building the request's output (a delta, or older trees' whole snapshot) and
    # joining deltas into the whole output.
    from pagoda.server.engine.sequence import Request

    output_s = [0.0]
    build_name = "take_output" if hasattr(Request, "take_output") else "to_output"
    build = getattr(Request, build_name)

    def timed_build(self):
        started = time.perf_counter()
        result = build(self)
        output_s[0] += time.perf_counter() - started
        return result

    setattr(Request, build_name, timed_build)
    # Trees that hand out deltas join them, as LLM.generate does; older ones hand out whole snapshots.
    collector = getattr(outputs_module, "OutputCollector", None)
    joined = collector() if collector else None
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True, logprobs=1)
    engine.add_request("long", PROMPT, params)
    steps: list[float] = []
    output_path: list[float] = []
    last = None
    while engine.has_unfinished():
        output_s[0] = 0.0
        started = time.perf_counter()
        outs = engine.step()
        joined_at = time.perf_counter()
        if joined is not None:
            joined.add(outs)
        elif outs:
            last = outs[-1]
        done = time.perf_counter()
        steps.append(done - started)
        output_path.append(output_s[0] + done - joined_at)
    final = joined["long"] if joined is not None else last
    assert final is not None and [len(c.token_ids) for c in final.outputs] == [max_tokens] * n, "short output"
    decode = list(zip(steps[1:], forward[1:], output_path[1:], strict=True))  # the first step is the prefill

    def ms(values: list[float], quantile: float) -> float:
        values = sorted(values)
        return values[int(len(values) * quantile)] * 1e3

    def summary(part: list[tuple[float, float, float]]) -> dict:
        overhead = [s - f for s, f, _ in part]
        return {"step_ms": ms([s for s, _, _ in part], 0.5), "forward_ms": ms([f for _, f, _ in part], 0.5),
                "overhead_ms": ms(overhead, 0.5), "overhead_p10_ms": ms(overhead, 0.1),
                "output_ms": ms([o for _, _, o in part], 0.5)}  # fmt: skip

    return {"steps": len(steps), "first": summary(decode[:window]), "last": summary(decode[-window:])}


def shim(tree: Path, into: Path) -> Path:
    """A folder where `import pagoda` finds `tree`'s sources (its package layout, linked)."""
    package = into / "pagoda"
    package.mkdir(parents=True)
    for entry in (tree / "pagoda").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_DIRS.items():
        (package / name).symlink_to(tree / folder)
    return into


def run_tree(tree: Path, model: Path, args: argparse.Namespace, scratch: Path) -> dict:
    path = shim(tree, scratch / f"shim-{len(list(scratch.iterdir()))}")
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import long_output, pagoda.server as s; "
        "assert s.__file__.startswith(sys.argv[2]), s.__file__; "
        "print(json.dumps(long_output.child(sys.argv[3], *map(int, sys.argv[4:]))))"
    )
    command = [sys.executable, "-c", code, str(ROOT / "benchmarks"), str(path), str(model),
               str(args.max_tokens), str(args.window), str(args.n)]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=path, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: the run failed\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_model(into: Path) -> Path:
    """The tiny random Llama of the tests (a transformers config, random weights, a real tokenizer)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.tiny_models import make_tiny_model

    return make_tiny_model("llama", into / "model", max_position_embeddings=8192)


@contextlib.contextmanager
def worktree(rev: str, scratch: Path):
    path = scratch / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", metavar="REV", help="also run a temporary git worktree of REV, first")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                        help="a source tree to run (repeatable; default: this tree)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--n", type=int, default=4, help="sequences of the request (each one output)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tree, alternating")
    args = parser.parse_args()
    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("this tree", str(ROOT))]
    with tempfile.TemporaryDirectory(prefix="long-output-") as tmp, contextlib.ExitStack() as stack:
        scratch = Path(tmp)
        if args.before:
            trees.insert(
                0, (f"before ({args.before})", str(stack.enter_context(worktree(args.before, scratch))))
            )
        model = build_model(scratch)
        print(f"n={args.n} x {args.max_tokens} output tokens, ms/step over decode steps 1-{args.window} vs the "
              f"last {args.window}; overhead = step - model forward (10th percentile and median); output "
              f"path = building the output and joining it (median)")  # fmt: skip
        print(f"{'tree':<22} {'overhead p10 first':>18} {'last':>7} {'ratio':>6}   {'median first':>12} "
              f"{'last':>7} {'ratio':>6}   {'output path first':>17} {'last':>7} {'ratio':>6}   "
              f"{'step ratio':>10} {'forward ratio':>13}")  # fmt: skip
        ratios: dict[str, list[float]] = {label: [] for label, _ in trees}
        for repeat in range(args.repeats):  # trees alternate, so a burst of load hits both alike
            for label, tree in trees:
                result = run_tree(Path(tree).resolve(), model, args, scratch)
                a, b = result["first"], result["last"]
                ratios[label].append(b["overhead_p10_ms"] / a["overhead_p10_ms"])
                print(f"{f'{label} #{repeat + 1}':<22} {a['overhead_p10_ms']:>18.3f} {b['overhead_p10_ms']:>7.3f} "
                      f"{ratios[label][-1]:>6.2f}   {a['overhead_ms']:>12.3f} "
                      f"{b['overhead_ms']:>7.3f} {b['overhead_ms'] / a['overhead_ms']:>6.2f}   "
                      f"{a['output_ms']:>17.3f} {b['output_ms']:>7.3f} {b['output_ms'] / a['output_ms']:>6.2f}   "
                      f"{b['step_ms'] / a['step_ms']:>10.2f} {b['forward_ms'] / a['forward_ms']:>13.2f}", flush=True)  # fmt: skip
        for label, values in ratios.items():
            print(f"{label}: overhead last/first (p10) over {len(values)} runs: median {sorted(values)[len(values) // 2]:.2f}, "
                  f"range {min(values):.2f}-{max(values):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
