"""The fault suite's runner: inject one fault at a time into real processes and measure what users saw.

    python e2e/faults.py engine-death|drain|cluster [--out DIR] [--outage-s 60] [--docs]

Scenarios (docs/reliability.md has the figures and plots):
- engine-death, drain: one `pagoda serve` process (e2e/fault_server.py);
- cluster: the real operator, real servers and a real Prometheus on the local stand-ins for a cluster
  (e2e/fault_cluster.py): a serving pod SIGKILLed mid-stream, the operator killed under load and
  during a scale-up, Prometheus down for --outage-s.
Each writes summary.json (figures and named checks) and its timeline PNGs under --out (with --docs
also into docs/img/); the exit code is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # as in e2e/local.py: the emulator and tiny models,
sys.path.append(str(REPO))  # and the repo root last (its `kernels/` must not shadow transformers' own)

from e2e.local import build_model  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python e2e/faults.py", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=["engine-death", "drain", "cluster"])
    p.add_argument("--out", type=Path, default=None, help="default: e2e/out/faults-<scenario>")
    p.add_argument("--outage-s", type=float, default=60.0,
                   help="how long Prometheus stays down (cluster); longer than the scale-down window, "
                   "so a scale-down on missing data would show")
    p.add_argument("--down-window", type=int, default=15, help="scaleDownStabilizationSeconds (cluster)")
    p.add_argument("--docs", action="store_true",
                   help="also copy the PNGs into docs/img/ (as reliability-<name>.png)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out or REPO / "e2e" / "out" / f"faults-{args.scenario}"
    out.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(REPO / "e2e" / "out")  # shared: built once per machine
    if args.scenario == "cluster":
        from e2e.fault_cluster import run_cluster_faults

        summary = asyncio.run(run_cluster_faults(model_dir, out, args.outage_s, args.down_window))
    else:
        from e2e import fault_server

        scenario = fault_server.engine_death if args.scenario == "engine-death" else fault_server.drain
        summary = asyncio.run(scenario(model_dir, out))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    checks = {name: ok for section in _sections(summary) for name, ok in section.get("checks", {}).items()}
    print(json.dumps(summary, indent=1))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if args.docs:
        for png in out.glob("*.png"):
            shutil.copy(png, REPO / "docs" / "img" / f"reliability-{png.name}")
    return 0 if checks and all(checks.values()) else 1


def _sections(summary: dict) -> list[dict]:
    """The summary itself (one scenario) or its per-fault parts (cluster)."""
    return [summary, *(v for v in summary.values() if isinstance(v, dict) and "checks" in v)]


if __name__ == "__main__":
    sys.exit(main())
