"""A CPU model's weights in one mapping backed by transparent huge pages.

A decode step streams every weight once. On 4 KiB pages the hardware prefetchers stop at each page
and the TLB misses every 4 KiB; on 2 MiB pages one stream runs on (Zen 4, 2 cores, a model's
projections at 16 rows: 13 -> 16.5 GB/s; docs/benchmarks.md). Linux hands huge pages to anonymous
memory that asks for them (`transparent_hugepage` set to `madvise`, the common default) or to all of
it (`always`); torch's allocator does not ask. So after loading, the large parameters and buffers are
copied into one anonymous mapping advised MADV_HUGEPAGE and the modules are pointed at it. The
tensors keep the mapping alive (torch.frombuffer holds it); values, dtypes, shapes and ties between
modules stay as they were.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20
# Smaller ones (norm weights, biases) take no time to stream and stay put. A small model's projection
# does not: SmolLM2's o in bf16 (648 KiB) took 27 µs a layer at one row on 4 KiB pages, 15-20 on huge
# ones (Zen 5); moving it and the 4-bit projections (166-885 KiB) too took one-row steps 0.92-0.95x
# (bf16) and 0.85-0.95x (GGUF) the time.
MIN_BYTES = 64 << 10
ALIGN = 4096


def huge_pages_available() -> bool:
    """The kernel gives huge pages to memory advised for them: mode `madvise` or `always`."""
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode and hasattr(mmap, "MADV_HUGEPAGE")


def _movable(tensor: torch.Tensor | None) -> bool:
    """A large CPU tensor that owns its whole storage (a view into a bigger one stays where it is)."""
    return (
        tensor is not None
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() >= MIN_BYTES
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def move_to_huge_pages(model: torch.nn.Module) -> int:
    """Copy `model`'s large CPU parameters and buffers into one huge-page mapping; the bytes moved
    (0 where the kernel gives no huge pages or nothing is large enough)."""
    if not huge_pages_available():
        return 0
    # (module, "_parameters" or "_buffers", name) of every slot, grouped by the tensor they hold
    slots: dict[tuple, tuple[torch.Tensor, list[tuple[torch.nn.Module, str, str]]]] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if _movable(tensor):
                    key = (tensor.data_ptr(), tensor.dtype, tensor.shape)
                    slots.setdefault(key, (tensor, []))[1].append((module, kind, name))
    if not slots:
        return 0
    nbytes = [t.numel() * t.element_size() for t, _ in slots.values()]
    sizes = [-(-n // ALIGN) * ALIGN for n in nbytes]
    mapping = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -arena.data_ptr() % HUGE_PAGE  # start on a huge-page boundary
    for (tensor, owners), n, size in zip(slots.values(), nbytes, sizes, strict=True):
        moved = arena[offset : offset + n].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor.detach())
        for module, kind, name in owners:
            if kind == "_parameters":
                getattr(module, kind)[name].data = moved  # the same Parameter object: ties hold
            else:
                getattr(module, kind)[name] = moved
        offset += size
    del arena  # the moved tensors hold the mapping
    logger.info("weights: %d tensors, %.0f MiB on huge pages", len(slots), sum(nbytes) / 2**20)
    return sum(nbytes)
