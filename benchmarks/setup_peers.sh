#!/usr/bin/env bash
# Install the peers that benchmarks/peer_serve.py compares pagoda with, each in a venv of its own
# under benchmarks/.peers/ (ignored by git):
#   transformers/  `transformers serve --continuous-batching` (transformers' serving extra)
#   llamacpp/      llama.cpp's OpenAI server (llama-cpp-python[server]; compiles for ~10 minutes)
# Idempotent: a venv whose peer already imports is left alone.
set -euo pipefail
cd "$(dirname "$0")"
peers=.peers
mkdir -p "$peers"
python=${PYTHON:-python3}
constraints=$(realpath ../constraints.txt)
LLAMA_CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 -DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16"

make_venv() {
  [ -x "$peers/$1/bin/python" ] || "$python" -m venv "$peers/$1"
  "$peers/$1/bin/python" -m pip --disable-pip-version-check -q install --upgrade pip
}

if ! "$peers/transformers/bin/python" -c "import transformers.commands.serving" 2>/dev/null; then
  make_venv transformers
  "$peers/transformers/bin/python" -m pip -q install -c "$constraints" "transformers[serving]" gguf
fi
# The default CPU build (what `pip install llama-cpp-python[server]` gives) except for AMX: on VMs that
# list AMX in cpuinfo without the hypervisor enabling its tile state, its AMX kernels die of SIGILL
# (seen here: tilezero in ggml_backend_amx_mul_mat, even after arch_prctl granted the permission).
if ! "$peers/llamacpp/bin/python" -c "import llama_cpp.server" 2>/dev/null \
  || [ "$(cat "$peers/llamacpp/.cmake_args" 2>/dev/null)" != "$LLAMA_CMAKE_ARGS" ]; then
  make_venv llamacpp
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$peers/llamacpp/bin/python" -m pip -q install --force-reinstall \
    --no-cache-dir "llama-cpp-python[server]"
  echo "$LLAMA_CMAKE_ARGS" > "$peers/llamacpp/.cmake_args"
fi
echo "peers installed in benchmarks/$peers"
