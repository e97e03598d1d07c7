"""The `pagoda` command: one entry point, one module per subcommand.

Each subcommand module exposes `HELP` (one line), `add_arguments(parser)` and `main(args) -> int`.
Modules keep heavy imports (torch, transformers) inside `main`, so `pagoda --help` and
`pagoda operator` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, str] = {
    "serve": "pagoda.server.serve_cli",
    "generate": "pagoda.server.engine.generate_cli",
    "plan": "pagoda.server.engine.plan_cli",
    "bench": "pagoda.server.bench_cli",
    "top": "pagoda.server.top_cli",
    "worker": "pagoda.server.worker_cli",
    "operator": "pagoda.operator.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Paged-KV LLM serving and its operator.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # a real missing dependency inside the module
                raise
            continue  # subcommand not built yet
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_handler=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
