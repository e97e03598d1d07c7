#!/usr/bin/env bash
# Apply the CPU example (examples/cpu-smollm2.yaml: the image's embedded default model, autoscaled
# 1-3), query it, load it, and watch it scale up and back down.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=e2e/kind/env.sh
source e2e/kind/env.sh
PORT="${PORT:-18000}"

kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -n "$NAMESPACE" -f examples/cpu-smollm2.yaml
# Short windows so the demo shows a scale-up and a scale-down within minutes.
kubectl patch -n "$NAMESPACE" "inferenceservice/${ISVC}" --type merge \
  -p '{"spec": {"autoscaling": {"intervalSeconds": 10, "scaleDownStabilizationSeconds": 60}}}'
echo "waiting for the first ready pod..."
kubectl wait -n "$NAMESPACE" "inferenceservice/${ISVC}" --for=condition=Ready --timeout=30m

kubectl port-forward -n "$NAMESPACE" "service/${ISVC}" "${PORT}:8000" >/dev/null &
forward=$!
trap 'kill "$forward" 2>/dev/null || true' EXIT
sleep 3

curl -fsS "http://127.0.0.1:${PORT}/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'
echo

# The load runs in the cluster (bench from the server image): a port-forward is too narrow a pipe.
# 32 clients × 320 tokens is more than one pod's 256 MiB KV pool (~5,700 tokens) holds.
kubectl delete pod -n "$NAMESPACE" pagoda-bench --ignore-not-found
kubectl run -n "$NAMESPACE" pagoda-bench --restart=Never --image="$SERVER_IMAGE" --image-pull-policy=Never \
  -- pagoda bench serve --base-url "http://${ISVC}:8000" \
  --num-prompts 600 --max-concurrency 32 --input-len 256 --output-len 64 --no-progress

# Watch replicas, KV usage (status.kvCache) and the autoscaler's reason every 10 s, until the load is
# over and the InferenceService is back at minReplicas.
columns='custom-columns=NAME:.metadata.name,DESIRED:.spec.replicas,READY:.status.ready,KV:.status.kvCache.usage,REASON:.status.autoscaling.reason'
phase() { kubectl get pod -n "$NAMESPACE" pagoda-bench -o jsonpath='{.status.phase}'; }
while [[ "$(phase)" != Succeeded && "$(phase)" != Failed ]]; do
  kubectl get -n "$NAMESPACE" "inferenceservice/${ISVC}" -o "$columns" --no-headers
  sleep 10
done
kubectl logs -n "$NAMESPACE" pagoda-bench
[[ "$(phase)" == Succeeded ]]
until [ "$(kubectl get -n "$NAMESPACE" "inferenceservice/${ISVC}" -o jsonpath='{.spec.replicas}')" = 1 ]; do
  kubectl get -n "$NAMESPACE" "inferenceservice/${ISVC}" -o "$columns" --no-headers
  sleep 10
done
kubectl get events -n "$NAMESPACE" --field-selector "involvedObject.name=${ISVC}" | grep -E 'Scaled(Up|Down)'
echo "scaled up and back down; Grafana: kubectl port-forward -n monitoring svc/kube-prometheus-stack-grafana 3000:80"
