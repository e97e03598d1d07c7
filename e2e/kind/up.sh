#!/usr/bin/env bash
# Build the images, create a kind cluster, install kube-prometheus-stack and the pagoda chart.
# Needs: docker, kind, kubectl, helm. Run from anywhere; it works from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=e2e/kind/env.sh
source e2e/kind/env.sh

# CPU images: the server Dockerfile's CUDA base and torch index are build arguments.
docker build -f docker/Dockerfile.server -t "$SERVER_IMAGE" \
  --build-arg CUDA_IMAGE=ubuntu:24.04 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
docker build -f docker/Dockerfile.operator -t "$OPERATOR_IMAGE" .

kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
kind load docker-image --name "$CLUSTER" "$SERVER_IMAGE" "$OPERATOR_IMAGE"

helm repo add prometheus-community https://prometheus-community.github.io/helm-charts --force-update
helm upgrade --install kube-prometheus-stack prometheus-community/kube-prometheus-stack \
  --namespace monitoring --create-namespace --wait --timeout 10m \
  --set grafana.sidecar.dashboards.enabled=true --set grafana.sidecar.dashboards.searchNamespace=ALL

helm upgrade --install pagoda charts/pagoda --namespace pagoda-system --create-namespace --wait \
  --set operator.image.pullPolicy=Never \
  --set serviceMonitor.enabled=true --set serviceMonitor.labels.release=kube-prometheus-stack

kubectl get pods -n pagoda-system
echo "cluster ${CLUSTER} is up: now run e2e/kind/demo.sh"
