"""The device's peak memory bandwidth and FLOP/s: the roofs a step's achieved numbers are divided by.

Known GPUs come from NVIDIA's datasheets (dense tensor-core numbers: the datasheets' bf16/fp16 figures
"with sparsity" are twice these; float32 is the non-tensor FP32 rate, since torch runs float32
matmuls without TF32 by default). Anything else, the CPU included, is measured at start-up by a short
probe: a large tensor copy (bytes read + written per second) and a square matmul in the model's dtype
(torch's, or on CPU the native kernel's, whichever is faster).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from pagoda.kernels import cpu_native

H200 = "https://www.nvidia.com/en-us/data-center/h200/"
H100 = "https://www.nvidia.com/en-us/data-center/h100/"
A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
L4 = "https://www.nvidia.com/en-us/data-center/l4/"

# (name fragment in torch.cuda.get_device_name, memory B/s, 16-bit tensor FLOP/s, FP32 FLOP/s, source);
# the first fragment that matches wins, so more specific names come first.
KNOWN_GPUS: tuple[tuple[str, float, float, float, str], ...] = (
    ("H200 NVL", 4.8e12, 835.5e12, 60e12, H200),
    ("H200", 4.8e12, 989.5e12, 67e12, H200),
    ("H100 NVL", 3.9e12, 835.5e12, 60e12, H100),
    ("H100 PCIe", 2.0e12, 756e12, 51e12, H100),
    ("H100", 3.35e12, 989.5e12, 67e12, H100),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100 80GB PCIe", 1.935e12, 312e12, 19.5e12, A100),
    ("A100-SXM4-80GB", 2.039e12, 312e12, 19.5e12, A100),
    ("A100", 1.555e12, 312e12, 19.5e12, A100),  # 40 GB, SXM4 and PCIe
    ("L4", 300e9, 121e12, 30.3e12, L4),
)


@dataclass(frozen=True)
class DevicePeaks:
    bytes_per_s: float
    flops_per_s: float
    source: str  # a datasheet URL, or "probe"

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte where the two roofs meet: a step below it is memory-bound."""
        return self.flops_per_s / self.bytes_per_s


def known_gpu_peaks(name: str, dtype: torch.dtype) -> DevicePeaks | None:
    for fragment, bandwidth, half_flops, fp32_flops, source in KNOWN_GPUS:
        if fragment in name:
            return DevicePeaks(bandwidth, fp32_flops if dtype == torch.float32 else half_flops, source)
    return None


def _best_time(fn, device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up: page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


@functools.lru_cache(maxsize=8)
def probe_peaks(device: torch.device, dtype: torch.dtype) -> DevicePeaks:
    """About 0.1-0.5 s: copy 128 MiB (far beyond any CPU cache), multiply two square matrices."""
    numel = (128 << 20) // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), device)
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    with torch.inference_mode():
        flops_per_s = 2 * n**3 / _best_time(lambda: a @ b, device)
        if device.type == "cpu":  # the engine's own kernel where it is the faster one (fp32 on Zen 5: ~2x)
            rows = a[:256].contiguous()
            if cpu_native.linear(rows, b, None) is not None:
                flops_per_s = max(flops_per_s, 2 * 256 * n * n / _best_time(lambda: cpu_native.linear(rows, b, None), device))
    return DevicePeaks(2 * numel * 4 / copy_s, flops_per_s, "probe")


def device_peaks(device: torch.device, dtype: torch.dtype) -> DevicePeaks:
    if device.type == "cuda":
        known = known_gpu_peaks(torch.cuda.get_device_name(device), dtype)
        if known is not None:
            return known
    return probe_peaks(device, dtype)
