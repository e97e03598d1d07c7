"""Rotary position embeddings: default and llama3-scaled frequencies."""

from __future__ import annotations

import math
from typing import Any

import torch
from pagoda.kernels import cpu_native
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "llama3")
MIN_TABLE_POSITIONS = 4096


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5.x keeps them in ``config.rope_parameters``; 4.x configs had ``rope_theta`` plus an
    optional ``rope_scaling`` dict (whose type key was once ``type``).
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_theta" not in params:
        raise ValueError(f"rope parameters {params} are per layer type or lack rope_theta; not supported")
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {params['rope_type']!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    return params


def inverse_frequencies(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies (same formulas and op order as transformers)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if params["rope_type"] == "default":
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's rotation angles, as transformers computes them: fp32 angles, their cos
    and sin, cast once to the dtype q and k rotate in. On CPU a step looks them up in tables per dtype,
    doubled whenever a step goes past them (a model's position limit can be a million: its table would
    be gigabytes): four ops where computing them took thirteen, each slow on the caches a decode step's
    weights have streamed through (about 0.1 ms of a one-row step), and none where the fused decode
    layers look each row up in their native call (`tables`). On a GPU they are computed per step: a
    CUDA graph replays that, and a lookup would need the largest position on the host."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(params, head_dim), persistent=False)
        # CPU: (cos, sin) tables per dtype, each [positions, 1, head_dim]
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [num_tokens, 1, head_dim] in `dtype`."""
        if positions.device.type != "cpu" or not positions.numel():
            return self.angles(positions, dtype)
        cos, sin = self.tables(dtype, int(positions.max()) + 1)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def tables(self, dtype: torch.dtype, end: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU (cos, sin) tables in `dtype`, each [positions, 1, head_dim], covering positions below
        `end` (the fused decode layers look their rows up themselves)."""
        tables = self._tables.get(dtype)
        if tables is None or tables[0].shape[0] < end:
            size = 2 * tables[0].shape[0] if tables is not None else MIN_TABLE_POSITIONS
            tables = self._tables[dtype] = self._build(max(end, size), dtype)
        return tables

    @torch.no_grad()
    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of `positions`, computed."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _build(self, num_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Blocks below torch's grain for splitting an elementwise op between threads: each block's cos
        # and sin run in whole vectors on one thread, as a decode step's own computation does, so a row
        # looked up holds the bits that step would have computed.
        per_block = max(1, 16384 // (2 * self.inv_freq.numel()))
        with torch.inference_mode(False):  # tables any later forward may read, in or out of inference mode
            blocks = [
                self.angles(torch.arange(start, min(start + per_block, num_positions)), dtype)
                for start in range(0, num_positions, per_block)
            ]
            return torch.cat([cos for cos, _ in blocks]), torch.cat([sin for _, sin in blocks])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate packed heads x [T, heads, D] (q, k, or both side by side) by this step's angles: in place
    where the native CPU kernel takes them (x is a step's own q/k, read by nothing else), else into a
    new tensor. torch's ops make a temporary each: at prompt sizes they cost more than the rotation."""
    if cpu_native.rotary(x, cos, sin):
        return x
    return x * cos + _rotate_half(x) * sin
