"""spec.model → where the serving pod reads the weights, and the model name clients send. Pure."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.operator import crd
from pagoda.server.model_download import MARKER as DOWNLOAD_MARKER  # noqa: F401 - the init container's

MODELS_DIR = "/models"


@dataclass(frozen=True)
class WeightsSource:
    """Where the server reads the weights, and whether the operator makes and fills a PVC for them."""

    scheme: str  # hf | pvc | file | embedded
    model_path: str | None  # PAGODA_MODEL inside the container; None: the image's embedded default
    claim: str | None = None  # the PVC mounted at /models
    repo_id: str | None = None  # hf:// only
    revision: str | None = None  # hf:// only

    @property
    def downloads(self) -> bool:
        return self.scheme == "hf"


# No uri: `pagoda serve` without --model serves the model the serving image embeds (SmolLM2-135M).
EMBEDDED_MODEL = WeightsSource("embedded", None)


def weights_source(model: dict[str, Any], owner_name: str) -> WeightsSource:
    return parse_model_uri(model["uri"], owner_name) if model.get("uri") else EMBEDDED_MODEL


def parse_model_uri(uri: str, owner_name: str) -> WeightsSource:
    if not re.fullmatch(crd.MODEL_URI_PATTERN[1:-1], uri):
        raise ValueError(f"unsupported model uri: {uri!r}")
    scheme, rest = uri.split("://", 1)
    if scheme == "hf":
        repo_id, _, revision = rest.partition("@")
        revision = revision or "main"
        return WeightsSource("hf", f"{MODELS_DIR}/hf/{repo_id}/{revision}", claim=weights_claim(owner_name),
                           repo_id=repo_id, revision=revision)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return WeightsSource("pvc", f"{MODELS_DIR}/{path}".rstrip("/"), claim=claim)
    return WeightsSource("file", rest)


def weights_claim(name: str) -> str:
    return f"{name}-weights"


# What `pagoda serve` names the model embedded in the serving image (it names it after the GGUF file).
EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"


def served_name(spec: Mapping[str, Any]) -> str | None:
    """The OpenAI model name: spec.model.servedName, else the uri's last path part without @revision;
    None for the embedded model (the server names it after the model)."""
    model = spec.get("model") or {}
    if model.get("servedName"):
        return model["servedName"]
    if not model.get("uri"):
        return None
    return model["uri"].split("://", 1)[1].split("@", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def client_model_name(spec: Mapping[str, Any]) -> str:
    """The `model` clients send, whichever source the weights come from."""
    return served_name(spec) or EMBEDDED_SERVED_NAME
