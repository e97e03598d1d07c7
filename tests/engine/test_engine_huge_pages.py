"""Weights moved into a huge-page mapping keep their values, ties and forward results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from pagoda.server.engine import huge_pages


class TiedModel(torch.nn.Module):
    """An embedding tied to its LM head (as SmolLM2's), one more projection, buffers large, mid-sized and
    small."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4096, 256)
        self.proj = torch.nn.Linear(256, 2048, bias=True)  # the bias is under the size limit
        self.head = torch.nn.Linear(2048, 4096, bias=False)
        self.tied = torch.nn.Linear(256, 4096, bias=False)
        self.tied.weight = self.embed.weight
        self.register_buffer("table", torch.randn(1024, 512))
        self.register_buffer("mid", torch.randn(128, 256))  # 128 KiB: a small model's projection
        self.register_buffer("small", torch.randn(16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        return self.tied(hidden) + self.head(self.proj(hidden)) + self.table.sum()


def _mapping_of(address: int) -> tuple[int, int, int]:
    """(start, end, AnonHugePages bytes) of the mapping of this process that holds `address`."""
    text = Path("/proc/self/smaps").read_text()
    for match in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?\nAnonHugePages:\s+(\d+) kB", text, re.M | re.S):
        start, end = int(match[1], 16), int(match[2], 16)
        if start <= address < end:
            return start, end, int(match[3]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not huge_pages.huge_pages_available(), reason="this kernel gives no transparent huge pages"
)
def test_large_tensors_move_into_one_huge_page_mapping() -> None:
    torch.manual_seed(0)
    model = TiedModel()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.tensor([[1, 7, 4095]])
    expected = model(ids)
    small_ptr, bias_ptr = model.small.data_ptr(), model.proj.bias.data_ptr()

    moved = huge_pages.move_to_huge_pages(model)

    large = [model.embed.weight, model.proj.weight, model.head.weight, model.table, model.mid]
    assert moved == sum(t.numel() * t.element_size() for t in large)
    assert model.tied.weight is model.embed.weight  # still one Parameter
    assert isinstance(model.embed.weight, torch.nn.Parameter) and model.embed.weight.requires_grad
    start, end, huge_bytes = _mapping_of(model.embed.weight.data_ptr())
    for tensor in large:
        assert start <= tensor.data_ptr() < tensor.data_ptr() + tensor.nbytes <= end
    assert huge_bytes >= huge_pages.HUGE_PAGE  # the kernel backed it with huge pages
    assert model.small.data_ptr() == small_ptr and model.proj.bias.data_ptr() == bias_ptr  # small: left
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert torch.equal(model(ids), expected)


def test_nothing_moves_where_the_kernel_gives_no_huge_pages(tmp_path, monkeypatch) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    model = TiedModel()
    pointers = [t.data_ptr() for t in model.state_dict().values()]
    assert huge_pages.move_to_huge_pages(model) == 0
    assert [t.data_ptr() for t in model.state_dict().values()] == pointers


def test_a_view_into_a_larger_storage_stays_where_it_is() -> None:
    model = torch.nn.Module()
    whole = torch.randn(2048, 512)
    model.register_buffer("rows", whole[:1024])  # 2 MiB, but half of a 4 MiB storage
    pointer = model.rows.data_ptr()
    huge_pages.move_to_huge_pages(model)
    assert model.rows.data_ptr() == pointer
