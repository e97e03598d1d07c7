#!/usr/bin/env bash
# inference-perf against `pagoda serve --vllm-compatible-metrics` on this machine, scraped by a real
# Prometheus (Debian's), reports in $OUT (default /tmp/pagoda-inference-perf). Loopback only.
#   benchmarks/inference_perf/run.sh            # the default model (SmolLM2-135M-Instruct), fp32, CPU
# Needs scripts/setup.sh --dev (prometheus) and inference-perf in a Python 3.12 venv:
#   PYENV_VERSION=3.12.1 python3.12 -m venv .venv-infperf
#   .venv-infperf/bin/python -m pip install -c constraints.txt inference-perf==0.7.0
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONSAFEPATH=1
out=${OUT:-/tmp/pagoda-inference-perf}
rm -rf "$out" && mkdir -p "$out"
model=smollm2
server_port=${SERVER_PORT:-8431}
prom_port=${PROMETHEUS_PORT:-9431}

# inference-perf counts tokens with a Hugging Face tokenizer folder: the default model's, from its GGUF.
.venv/bin/python - "$out/tokenizer" <<'PY'
import sys
from pagoda.server.engine.loader import default_gguf_path
from transformers import AutoTokenizer
path = default_gguf_path()
AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(sys.argv[1])
PY

.venv/bin/pagoda serve --dtype float32 --host 127.0.0.1 --port "$server_port" --served-model-name "$model" \
  --vllm-compatible-metrics >"$out/serve.log" 2>&1 &
server_pid=$!
cat >"$out/prometheus.yml" <<YAML
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: pagoda
    static_configs: [{targets: ["127.0.0.1:$server_port"]}]
YAML
prometheus --config.file="$out/prometheus.yml" --storage.tsdb.path="$out/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" >"$out/prometheus.log" 2>&1 &
prom_pid=$!
trap 'kill "$server_pid" "$prom_pid" 2>/dev/null || true' EXIT

for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$server_port/ready" >/dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$server_port/ready" >/dev/null

sed -e "s#@MODEL@#$model#" -e "s#@SERVER_URL@#http://127.0.0.1:$server_port#" \
    -e "s#@TOKENIZER@#$out/tokenizer#" -e "s#@PROMETHEUS_URL@#http://127.0.0.1:$prom_port#" \
    -e "s#@REPORT_DIR@#$out/reports#" benchmarks/inference_perf/config.template.yaml >"$out/config.yaml"
HF_HUB_OFFLINE=1 .venv-infperf/bin/inference-perf --config_file "$out/config.yaml" 2>&1 | tee "$out/inference-perf.log"
sleep 2  # one more scrape
echo "reports in $out/reports"
