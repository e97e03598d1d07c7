"""Evaluation-harness tests: the tiny random Llama, saved as a Hugging Face folder once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tiny_models import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_model_dir("llama", tmp_path_factory)
