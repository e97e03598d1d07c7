#!/usr/bin/env bash
# `pagoda bench serve` against `pagoda serve` (embedded SmolLM2-135M-Instruct) at concurrency 1, 8, 32, 64,
# with the offline engine on the same workload for the HTTP/offline throughput ratio (docs/benchmarks.md).
#   benchmarks/serve_sweep.sh [RESULT_JSON (default out/serve_sweep.json)]; extra `pagoda bench serve` flags via BENCH_FLAGS
# Server and client run in one session (setsid) so the kernel's per-session CPU share (autogroup)
# treats the HTTP and the offline runs alike on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PAGODA_SWEEP_SESSION:-}" ]; then
  PAGODA_SWEEP_SESSION=1 exec setsid "$0" "$@"
fi
mkdir -p out
result=${1:-out/serve_sweep.json}
port=${PORT:-8765}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one torch thread: no spinning against other load
.venv/bin/pagoda serve --host 127.0.0.1 --port "$port" --log-level warning >out/serve_sweep.log 2>&1 &
server=$!
trap 'kill -TERM "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do
  curl -sf "localhost:$port/ready" >/dev/null && break
  sleep 3
done
# shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
.venv/bin/pagoda bench serve --base-url "http://127.0.0.1:$port" --tokenizer default \
  --max-concurrency 1,8,32,64 --num-prompts 8,32,64,128 --input-len 32 --output-len 16 \
  --offline --repeats 2 --no-progress --save-result "$result" ${BENCH_FLAGS:-}
