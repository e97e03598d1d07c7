"""The native CPU kernels of `cpu_native.c`: built on first use with the machine's C compiler, loaded
with ctypes, and shared by every process through a cache folder keyed by the source and the CPU.

Every entry point returns None where it cannot run (no compiler, a dtype or shape it does not take,
``PAGODA_NATIVE_KERNELS=0``): the caller then runs its torch path, which stays the oracle in tests.
The build takes about a second; a failed one is logged once and not retried by this process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_NOT_BUILT = object()
_library = _NOT_BUILT
_lock = threading.Lock()


def _cache_dirs() -> list[Path]:
    configured = os.environ.get("PAGODA_KERNEL_CACHE")
    if configured:
        return [Path(configured)]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [home / "pagoda" / "kernels", Path(tempfile.gettempdir()) / "pagoda-kernels"]


def _cpu_signature() -> str:
    """-march=native code is only valid on CPUs with the same features (a cache on a shared volume)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _loaded_openmp() -> str:
    """The OpenMP runtime torch loaded (by path): linking against that very file makes the kernels'
    parallel loops run on torch's thread team (a second runtime would start a second team)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libgomp" in line.rsplit("/", 1)[-1]:
                return line.split()[-1]
    except OSError:
        pass
    return "-lgomp"


def _build(compiler: str) -> Path:
    openmp = _loaded_openmp()
    digest = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *FLAGS, openmp, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    errors = []
    for folder in _cache_dirs():
        target = folder / f"pagoda_cpu_native-{digest}.so"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                obj, built = Path(scratch) / "kernels.o", Path(scratch) / target.name
                for command in (
                    [compiler, *FLAGS, "-c", "-o", str(obj), str(SOURCE)],
                    [compiler, "-shared", "-o", str(built), str(obj), openmp, "-lm"],  # no second -lgomp
                ):
                    subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
                os.replace(built, target)  # atomic: a process building alongside finds a whole file
            return target
        except subprocess.CalledProcessError as error:
            raise RuntimeError(f"{compiler} failed: {error.stderr.strip()[-2000:]}") from error
        except OSError as error:  # an unwritable cache folder: try the next one
            errors.append(f"{folder}: {error}")
    raise RuntimeError("no writable kernel cache folder: " + "; ".join(errors))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.pagoda_paged_decode_attention.argtypes = [
        p, i64, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, i32, f32, i32, i32, i32
    ]
    for name in ("pagoda_linear_bf16", "pagoda_linear_bf16_amx", "pagoda_linear_f32"):
        getattr(lib, name).argtypes = [p, p, p, p, i32, i32, i32, i32]
    lib.pagoda_rms_norm.argtypes = [p, p, p, p, p, i32, i32, f32, i32, i32]
    lib.pagoda_silu_mul.argtypes = [p, p, i32, i32, i32, i32]
    lib.pagoda_store_kv.argtypes = [p, i64, p, i64, p, p, p, i32, i32, i64, i32]
    lib.amx = lib.pagoda_amx_init() == 0  # tile registers granted to this process
    lib.max_head_dim, lib.max_group = lib.pagoda_max_head_dim(), lib.pagoda_max_group()
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built here."""
    global _library
    if _library is not _NOT_BUILT:
        return _library
    with _lock:
        if _library is _NOT_BUILT:
            _library = None
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if os.environ.get("PAGODA_NATIVE_KERNELS", "1") == "0":
                logger.info("native CPU kernels off (PAGODA_NATIVE_KERNELS=0): torch's kernels run")
            elif compiler is None:
                logger.warning("no C compiler: native CPU kernels unavailable, torch's kernels run")
            else:
                try:
                    _library = _declare(ctypes.CDLL(str(_build(compiler))))
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
                    logger.warning("native CPU kernels unavailable, torch's kernels run: %s", error)
    return _library


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    dtype = DTYPES.get(query.dtype)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    lib = library() if query.device.type == "cpu" else None
    if (
        lib is None
        or dtype is None
        or not (k_cache.dtype == v_cache.dtype == query.dtype)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or query.stride(2) != 1
        or head_dim > lib.max_head_dim
        or num_heads % num_kv_heads
        or num_heads // num_kv_heads > lib.max_group
    ):
        return None
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype)
    status = lib.pagoda_paged_decode_attention(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, k_cache.shape[1], k_cache.shape[0],
        scale, sliding_window or 0, dtype, torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise IndexError("a block table entry is outside the KV cache")
    return out if status == 0 else None


# Rows up to which each kernel beats torch's (oneDNN/MKL) GEMM on a whole model's weights, 2 cores,
# SmolLM2-135M shapes (docs/benchmarks.md), on the two CPUs measured. Sapphire Rapids (AMX): AMX bf16
# 1.5-2.4x at 1-16 rows, AVX-512 bf16 dot products only at one row, fp32 1.2-1.4x up to 4 rows (past
# that its two 512-bit FMA units make oneDNN the faster). Zen 4 (AVX512-BF16, no AMX): both dot-product
# kernels ahead of torch at every row count to 64 (bf16 1.1-1.5x, fp32 1.1-3x).
AMX_MAX_ROWS = 16


def max_rows(lib: ctypes.CDLL, dtype: torch.dtype) -> int:
    """Rows up to which the AVX-512 dot-product kernel of `dtype` runs (0: never)."""
    if dtype == torch.bfloat16:
        return 0 if not lib.pagoda_has_bf16_linear() else 1 if lib.amx else 64
    return 0 if not lib.pagoda_has_f32_linear() else 4 if lib.amx else 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]ᵀ (+ bias) in x's dtype (fp32 accumulation), for decode-sized steps."""
    if x.device.type != "cpu":
        return None  # checked first: a GPU process never builds the library
    lib = library()
    if lib is None or x.dtype != weight.dtype or not weight.is_contiguous():
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return None
    out_features, in_features = weight.shape
    num_rows = x.numel() // in_features
    if x.dtype == torch.bfloat16:
        if lib.amx and num_rows <= AMX_MAX_ROWS and in_features % 32 == 0 and out_features >= 16:
            kernel = lib.pagoda_linear_bf16_amx
        elif num_rows <= max_rows(lib, x.dtype):
            kernel = lib.pagoda_linear_bf16
        else:
            return None
    elif x.dtype == torch.float32 and num_rows <= max_rows(lib, x.dtype):
        kernel = lib.pagoda_linear_f32
    else:
        return None
    rows = x.reshape(num_rows, in_features).contiguous()
    y = torch.empty(num_rows, out_features, dtype=x.dtype)
    status = kernel(rows.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(),
                    num_rows, out_features, in_features, torch.get_num_threads())  # fmt: skip
    return y.view(*x.shape[:-1], out_features) if status == 0 else None


def _takes(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, if every tensor is a CPU tensor of one dtype it takes."""
    dtype = tensors[0].dtype
    if dtype not in DTYPES or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return None
    return library()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight * rmsnorm(x), None), or with `residual`: (weight * rmsnorm(x + residual), x + residual)."""
    extra = () if residual is None else (residual,)
    lib = _takes(x, weight, *extra)
    if lib is None or not all(t.is_contiguous() for t in (x, weight, *extra)):
        return None
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    hidden = x.shape[-1]
    status = lib.pagoda_rms_norm(x.data_ptr(), _ptr(residual), _ptr(summed), weight.data_ptr(), out.data_ptr(),
                                 x.numel() // hidden, hidden, eps, DTYPES[x.dtype], torch.get_num_threads())  # fmt: skip
    return (out, summed) if status == 0 else None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of gate_up [..., 2 * inter] (gate first), rounded where torch's two ops round."""
    lib = _takes(gate_up)
    if lib is None or not gate_up.is_contiguous():
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    status = lib.pagoda_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
                                 DTYPES[gate_up.dtype], torch.get_num_threads())  # fmt: skip
    return out if status == 0 else None


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """key/value [tokens, kv_heads, head_dim] into the caches' slots (-1: skipped); False where the
    kernel does not take the tensors (the caller stores them)."""
    lib = _takes(key, value, k_cache, v_cache)
    rows_contiguous = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
    if (
        lib is None
        or key.shape != value.shape
        or not rows_contiguous
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        return False
    status = lib.pagoda_store_kv(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), key.shape[0], key.shape[1] * key.shape[2],
        k_cache.shape[0] * k_cache.shape[1], DTYPES[key.dtype],
    )  # fmt: skip
    if status != 0:
        raise IndexError("a slot is outside the KV cache")
    return True
