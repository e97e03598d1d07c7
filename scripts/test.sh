#!/usr/bin/env bash
# Set up from scratch (idempotent) and run the whole test suite: lint, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
export PATH="$PWD/.venv/bin:$PATH"
ruff check .
exec python -m pytest "$@"
