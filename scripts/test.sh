#!/usr/bin/env bash
# Set up from scratch (idempotent) and run the whole test suite: lint, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo root holds a folder named `operator` (a stdlib name): never let `python -m` put the
# working directory on sys.path.
export PYTHONSAFEPATH=1
scripts/setup.sh --dev
export PATH="$PWD/.venv/bin:$PATH"
ruff check .
exec python -m pytest "$@"
