"""What the CPU a serving process runs on can do: how many cores it may use, whether it has native bf16."""

from __future__ import annotations

import math
import os
from functools import cache
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cgroup_cpu_limit() -> float | None:
    """The container's CPU limit in cores (Kubernetes `resources.limits.cpu`), None when unlimited."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(CGROUP_V1_QUOTA.read_text())
        return None if quota_us <= 0 else quota_us / int(CGROUP_V1_PERIOD.read_text())
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by the cgroup CPU limit (rounded up).
    A pod limited to 2 CPUs on a 64-core node must not start 64 threads that the kernel throttles."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return cores


@cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX): bf16 GEMMs then run 2-3x faster than fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
