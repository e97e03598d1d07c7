#!/usr/bin/env bash
# Delete the kind cluster made by up.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=e2e/kind/env.sh
source e2e/kind/env.sh
kind delete cluster --name "$CLUSTER"
