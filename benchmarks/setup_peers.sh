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

make_venv() {
  [ -x "$peers/$1/bin/python" ] || "$python" -m venv "$peers/$1"
  "$peers/$1/bin/python" -m pip --disable-pip-version-check -q install --upgrade pip
}

if ! "$peers/transformers/bin/python" -c "import transformers.commands.serving" 2>/dev/null; then
  make_venv transformers
  "$peers/transformers/bin/python" -m pip -q install -c "$constraints" "transformers[serving]" gguf
fi
if ! "$peers/llamacpp/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
  make_venv llamacpp
  # The default CPU build: what a user who runs `pip install llama-cpp-python[server]` gets.
  "$peers/llamacpp/bin/python" -m pip -q install "llama-cpp-python[server]"
fi
echo "peers installed in benchmarks/$peers"
