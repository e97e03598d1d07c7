"""The Dockerfiles cannot be built here (no Docker engine): check them at parse level instead —
sources exist and reach the build context, non-root users, the pagoda entry points, the torch pin,
and an operator image whose dependency list covers every third-party import of operator/."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import json
import re
import subprocess
import sys

import pytest
import tomllib
import yaml
from chart_support import CHART, REPO

DOCKER = REPO / "docker"
IMAGES = {"server": DOCKER / "Dockerfile.server", "operator": DOCKER / "Dockerfile.operator"}


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), " ".join(rest.split())))
    return result


def args_of(path, keyword: str) -> list[str]:
    return [rest for kw, rest in instructions(path) if kw == keyword]


def build_arg_default(path, name: str) -> str:
    (value,) = [rest.split("=", 1)[1] for rest in args_of(path, "ARG") if rest.startswith(name + "=")]
    return value


def in_build_context(source: str) -> bool:
    """Docker's .dockerignore semantics for our allow-list file: the last matching pattern wins."""
    included = True
    for pattern in (REPO / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(source.rstrip("/"), pattern):
            included = negate
    return included


def packaged_source_dirs() -> set[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()}


@pytest.mark.parametrize("image", IMAGES)
def test_copy_sources_exist_and_are_in_the_build_context(image):
    copied = set()
    for rest in args_of(IMAGES[image], "COPY"):
        *sources, _destination = rest.split()
        for source in sources:
            assert (REPO / source).exists(), f"{image}: COPY {source}: no such path"
            assert in_build_context(source), f"{image}: COPY {source}: excluded by .dockerignore"
            copied.add(source.rstrip("/"))
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = packaged_source_dirs() | {"pyproject.toml", pyproject["project"]["readme"], "constraints.txt"}
    assert needed <= copied, f"{image}: not copied: {needed - copied}"


@pytest.mark.parametrize("image", IMAGES)
def test_runs_as_non_root_with_the_pagoda_entrypoint(image):
    path = IMAGES[image]
    user = args_of(path, "USER")[-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"{image}: USER {user} (numeric, so runAsNonRoot can verify it)"
    assert instructions(path)[-1][0] in {"CMD", "ENTRYPOINT"}  # nothing runs as root after USER
    assert [kw for kw, _ in instructions(path)].index("USER") > max(
        i for i, (kw, _) in enumerate(instructions(path)) if kw == "RUN"
    ), f"{image}: a RUN after USER"
    assert json.loads(args_of(path, "ENTRYPOINT")[-1]) == ["pagoda"]
    assert json.loads(args_of(path, "CMD")[-1])[0] == ("serve" if image == "server" else "operator")


def test_server_image_is_cuda_with_the_torch_pin():
    path = IMAGES["server"]
    base = build_arg_default(path, "CUDA_IMAGE")
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    assert args_of(path, "FROM") == ["${CUDA_IMAGE}"]
    cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", base).groups()
    index = build_arg_default(path, "TORCH_INDEX_URL")
    assert index.endswith(f"/cu{''.join(cuda)}"), "torch's CUDA build must match the base image's CUDA"
    runs = " ".join(args_of(path, "RUN"))
    assert '--index-url "${TORCH_INDEX_URL}"' in runs and "torch==2.13.0" in runs
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()
    assert "8000" in args_of(path, "EXPOSE")[0].split()


def operator_third_party_imports() -> set[str]:
    names = set()
    for source in (REPO / "operator").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name != "pagoda"}


def test_operator_image_is_slim_and_installs_every_operator_import():
    path = IMAGES["operator"]
    assert re.fullmatch(r"python:3\.\d+-slim", build_arg_default(path, "PYTHON_IMAGE"))
    runs = " ".join(args_of(path, "RUN"))
    assert "torch" not in runs and "pip install --no-deps ." in runs
    installed = {re.split(r"[<>=\"]", word.strip('"'))[0].lower().replace("-", "_") for word in runs.split()}
    distributions = importlib.metadata.packages_distributions()
    imports = operator_third_party_imports()
    assert {"kopf", "prometheus_client"} <= imports
    for module in imports:
        dists = {d.lower().replace("-", "_") for d in distributions.get(module, [module])}
        assert dists & installed, (
            f"operator/ imports {module} ({dists}); Dockerfile.operator does not install it"
        )
    assert set(args_of(path, "EXPOSE")[0].split()) == {"8080", "8081"}


def test_operator_command_starts_without_the_model_stack():
    """What the slim image has: `pagoda operator --help` must work with torch & co absent."""
    blocked = ["torch", "transformers", "numpy", "triton", "safetensors", "tokenizers", "gguf", "accelerate",
               "huggingface_hub", "matplotlib", "jinja2"]  # fmt: skip
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "from pagoda.cli import main\n"
        "sys.exit(main(['operator', '--help']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in (
        "--namespace",
        "--all-namespaces",
        "--health-port",
        "--metrics-port",
        "--standalone",
        "--peering",
    ):
        assert flag in result.stdout, flag


def test_chart_defaults_point_at_these_images():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for image, key in (("server", "server"), ("operator", "operator")):
        repository = values[key]["image"]["repository"]
        assert repository == f"ghcr.io/pagoda-dev/pagoda-{image}"
        assert f"-t {repository}:{app_version} ." in IMAGES[image].read_text()
