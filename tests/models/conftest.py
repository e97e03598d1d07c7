"""Session-scoped tiny model folders (one per family) and the embedded SmolLM2 GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tiny_models import TINY_FAMILIES, tiny_model_dir


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    """(family, folder) for every tiny family."""
    return request.param, tiny_model_dir(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return tiny_model_dir("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return tiny_model_dir("mistral", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory) -> Path:
    return tiny_model_dir("llama3", tmp_path_factory)
