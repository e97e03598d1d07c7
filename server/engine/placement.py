"""Where the engine runs: the torch device, and on CPU how many threads torch may use."""

from __future__ import annotations

import os

import torch
from pagoda.server.engine.cpu import usable_cores


def set_cpu_threads(threads: int | None) -> None:
    """torch's intra-op threads: as asked, else OMP_NUM_THREADS if set, else the usable cores."""
    if threads is None and "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(threads or usable_cores())


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
