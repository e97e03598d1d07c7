"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported (kernels are bound at decoration time).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from pagoda.kernels.reference import TorchReferenceBackend


@pytest.fixture
def reference() -> TorchReferenceBackend:
    return TorchReferenceBackend()


@pytest.fixture
def generator(request) -> torch.Generator:
    """Seeded per test id: random, yet each case reproduces on its own."""
    return torch.Generator().manual_seed(sum(map(ord, request.node.nodeid)))
