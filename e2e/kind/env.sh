#!/usr/bin/env bash
# Shared settings of the kind scripts (sourced; override any of them from the environment).
CLUSTER="${CLUSTER:-pagoda}"
NAMESPACE="${NAMESPACE:-pagoda-demo}"
VERSION="${VERSION:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/pagoda/Chart.yaml)}"
SERVER_IMAGE="${SERVER_IMAGE:-ghcr.io/pagoda-dev/pagoda-server:${VERSION}}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-ghcr.io/pagoda-dev/pagoda-operator:${VERSION}}"
ISVC="${ISVC:-smollm2-cpu}"
export CLUSTER NAMESPACE VERSION SERVER_IMAGE OPERATOR_IMAGE ISVC
