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
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = ["-O3", "-fopenmp", "-fPIC"]
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


def _flags() -> list[str]:
    """This CPU's instruction set, or the one `PAGODA_NATIVE_MARCH` names (e.g. x86-64-v3: the AVX2
    kernels on an AVX-512 CPU, as tests check them)."""
    return [*FLAGS, "-march=" + os.environ.get("PAGODA_NATIVE_MARCH", "native")]


def _build(compiler: str) -> Path:
    openmp, flags = _loaded_openmp(), _flags()
    digest = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *flags, openmp, _cpu_signature()]).encode()
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
                    [compiler, *flags, "-c", "-o", str(obj), str(SOURCE)],
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
    for name in ("pagoda_linear_bf16", "pagoda_linear_bf16_amx", "pagoda_linear_f32", "pagoda_linear_f32_bf16w"):
        getattr(lib, name).argtypes = [p, p, p, p, i32, i32, i32, i32]
    lib.pagoda_prefill_attention.argtypes = [
        p, i64, i64, p, p, p, i64, p, p, p, i32, i32, i32, i32, i32, i32, f32, i32, i32, i32
    ]
    lib.pagoda_rms_norm.argtypes = [p, p, p, p, p, i32, i32, f32, i32, i32]
    lib.pagoda_silu_mul.argtypes = [p, p, i32, i32, i32, i32]
    lib.pagoda_rotary.argtypes = [p, i64, i32, i32, i32, p, p, i32, i32]
    lib.pagoda_argmax_logsumexp.argtypes = [p, i32, i32, p, p, i32]
    lib.pagoda_sample_rows.argtypes = [p, i32, i32, i32, p, p, p, p, i32]
    lib.pagoda_store_kv.argtypes = [p, i64, p, i64, p, p, p, i32, i32, i64, i32]
    lib.pagoda_decode_layers.argtypes = [p, i32, p, p, p, p, p, p, i64, p, p, p, i64, p, i32, i32]
    lib.pagoda_linear_int4.argtypes = [p, p, p, p, p, p, i32, i32, i32, i32, i32, i32]
    lib.pagoda_linear_int8.argtypes = [p, p, p, p, p, i32, i32, i32, i32, i32]
    lib.amx = lib.pagoda_amx_init() == 0  # tile registers granted to this process
    lib.lanes = lib.pagoda_vector_lanes()  # 16: AVX-512, 8: AVX2, 0: no vector kernels
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


def _attention_takes(lib: ctypes.CDLL, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> bool:
    num_kv_heads, head_dim = k_cache.shape[2:]
    return (
        k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and head_dim <= lib.max_head_dim
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= lib.max_group
    )


def _attention_library(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels, where an attention kernel reads these tensors as they are (CPU, one dtype they
    compute in, rows of contiguous heads, caches and GQA shapes `_attention_takes`); else None."""
    lib = library() if query.device.type == "cpu" else None
    if (
        lib is None
        or query.dtype not in DTYPES
        or not (k_cache.dtype == v_cache.dtype == query.dtype)
        or query.stride(-1) != 1
        or not _attention_takes(lib, k_cache, v_cache, query.shape[1])
    ):
        return None
    return lib


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    lib = _attention_library(query, k_cache, v_cache)
    if lib is None:
        return None
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype)
    status = lib.pagoda_paged_decode_attention(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, k_cache.shape[1], k_cache.shape[0],
        scale, sliding_window or 0, DTYPES[query.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise IndexError("a block table entry is outside the KV cache")
    return out if status == 0 else None


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the new tokens of every sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]: sequence s's new tokens are rows cu[s]..cu[s + 1]
    context_lens: torch.Tensor,  # [num_seqs]: cached + new tokens
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """Causal attention of new tokens to their sequences' caches, tiles of tokens at a time (the
    AVX-512 kernel); None where it does not run."""
    num_heads, head_dim = query.shape[1:]
    lib = _attention_library(query, k_cache, v_cache)
    if lib is None or not has_tiled_prefill(head_dim):
        return None
    tables = block_tables.to(torch.int32).contiguous()
    starts = cu_seqlens_q.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(query.shape[0], num_heads, head_dim, dtype=query.dtype)
    status = lib.pagoda_prefill_attention(
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0), starts.data_ptr(), lens.data_ptr(), out.data_ptr(), lens.shape[0],
        num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], k_cache.shape[0], scale, sliding_window or 0,
        DTYPES[query.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise IndexError("a block table entry is outside the KV cache")
    return out if status == 0 else None


# Rows up to which each kernel beats torch's (oneDNN/MKL) GEMM on a whole model's weights, 2 cores,
# SmolLM2-135M shapes (docs/benchmarks.md), on the two CPUs measured. Sapphire Rapids class (AMX):
# the AVX-512 bf16 dot products at one row (10.3-11.0 ms vs AMX's 11.4-12.0, torch's 24-26), AMX bf16
# at 2-512 rows (1.5-2x torch's to 32 rows, 1.1-1.5x at 64-128; level to behind at 256-512 alone, but
# steps to 512 rows then run as one native call: offline c64 bf16 3-5 % faster than with AMX to 256
# rows; 0.9x at 1024), fp32 dot products to 128 rows (1.4-1.5x at 16-32 rows, level at 96-128:
# 0.94-1.04x in two runs, 0.9x at 256). Zen 4
# (AVX512-BF16, no AMX): both dot-product kernels ahead of torch at every row count to 128 (bf16
# 1.1-1.5x, fp32 1.1-3x), even with oneDNN around 256 rows, where a mixed step (a prompt joining 15
# decodes) then runs all its layers in one native call: 185 rows bf16 170 -> 150 ms; the fp32
# workload of benchmarks/peer_serve.py ~2 % faster offline at 256 rows than at 128. oneDNN wins past
# them in bf16. In fp32 without AMX the native kernels take every step, from 256 rows the packed
# outer-product one (`PACKED_MIN_ROWS`): Zen 5, SmolLM2's projections at 256-2,048 rows, 301-378
# GFLOP/s against oneDNN's 157-170 (its bf16 one wins there from 128 rows: 546-736 against 477-506).
# AVX2 (Zen 3, no AVX-512): fp32 at every size, the 8-lane dot products to 47 rows (1.4-3.7x at 1-32
# rows; from 12 rows the rows-in-lanes kernel instead, `LANES_MIN_ROWS`: 1.2-1.4x the dot products at
# 16) and 16-output packed panels from 48 (`PACKED_MIN_ROWS`: SmolLM2's projections at 48 / 128
# / 256 / 1,024 rows 127 / 150 / 160 / 164 GFLOP/s against oneDNN's 90 / 96 / 117 / 147); bf16 (widened
# to fp32 in registers) at every size, from 12 rows in lanes: 138-151 GFLOP/s (the dot products 84-96)
# against torch's 15-20, which has no bf16 arithmetic to use there.
EVERY_STEP = 2**31 - 1
AMX_MAX_ROWS = 512
DOT_BF16_MAX_ROWS = 256
DOT_F32_MAX_ROWS = EVERY_STEP
AMX_CPU_F32_MAX_ROWS = 128
AVX2_F32_MAX_ROWS = EVERY_STEP
AVX2_BF16_MAX_ROWS = EVERY_STEP


def max_rows(lib: ctypes.CDLL, dtype: torch.dtype) -> int:
    """Rows up to which the vector kernel of `dtype` (`pagoda_linear_bf16` / `_f32`: dot-product tiles,
    for fp32 packed panels from PACKED_MIN_ROWS: 256 with AVX-512, 48 on AVX2) runs (0: never)."""
    avx512 = lib.lanes == 16
    if dtype == torch.bfloat16:
        if not lib.pagoda_has_bf16_linear():
            return 0
        return 1 if lib.amx else DOT_BF16_MAX_ROWS if avx512 else AVX2_BF16_MAX_ROWS
    if not lib.pagoda_has_f32_linear():
        return 0
    return AMX_CPU_F32_MAX_ROWS if lib.amx else DOT_F32_MAX_ROWS if avx512 else AVX2_F32_MAX_ROWS


LINEAR_DOT, LINEAR_AMX, LINEAR_INT4 = 0, 1, 2  # cpu_native.c's kernels for a projection


def has_tiled_prefill(head_dim: int) -> bool:
    """The tiled prefill attention (AVX-512 only, head sizes in whole vectors) is built here and takes
    heads of `head_dim`; elsewhere it declines."""
    lib = library()
    return lib is not None and lib.lanes == 16 and head_dim % 16 == 0 and head_dim <= lib.max_head_dim


def has_vector_kernels() -> bool:
    """The vector kernels (AVX-512 or AVX2: SiLU x up, the low-bit linears, the fused decode layers)
    are built here."""
    lib = library()
    return lib is not None and lib.lanes > 0


def widens(weight_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """The fp32 kernels read a bf16 weight as it is (widened in registers, exactly): a checkpoint of
    bf16 values served in fp32 keeps its weights in bf16 (`layers/bf16_storage.py`)."""
    return weight_dtype == torch.bfloat16 and dtype == torch.float32


def linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, dtype: torch.dtype) -> int | None:
    """The native kernel that computes rows (in `dtype`) x weightᵀ (+ bias) faster than torch's GEMM
    (LINEAR_DOT or LINEAR_AMX), or None where none does or takes the tensors: the one rule for both
    `linear` and the fused decode layers."""
    if weight.device.type != "cpu":
        return None  # checked first: a GPU process never builds the library
    lib = library()
    if lib is None or dtype not in DTYPES or not weight.is_contiguous():
        return None
    if weight.dtype != dtype and not widens(weight.dtype, dtype):
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    out_features, in_features = weight.shape
    if rows <= max_rows(lib, dtype):
        return LINEAR_DOT
    amx_takes = in_features % 32 == 0 and out_features >= 16
    if weight.dtype == dtype == torch.bfloat16 and lib.amx and rows <= AMX_MAX_ROWS and amx_takes:
        return LINEAR_AMX
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]ᵀ (+ bias) in x's dtype (fp32 accumulation), where `linear_kernel` has a
    native kernel for the step; else None."""
    out_features, in_features = weight.shape
    num_rows = x.numel() // in_features
    kernel = linear_kernel(weight, bias, num_rows, x.dtype)
    if kernel is None:
        return None
    lib = library()
    if kernel == LINEAR_AMX:
        run = lib.pagoda_linear_bf16_amx
    elif x.dtype == torch.bfloat16:
        run = lib.pagoda_linear_bf16
    else:
        run = lib.pagoda_linear_f32_bf16w if widens(weight.dtype, x.dtype) else lib.pagoda_linear_f32
    flat = x.dim() == 2 and x.is_contiguous()  # no reshape and view around the call (a decode step's head)
    rows = x if flat else x.reshape(num_rows, in_features).contiguous()
    y = torch.empty(num_rows, out_features, dtype=x.dtype)
    status = run(rows.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(),
                 num_rows, out_features, in_features, torch.get_num_threads())  # fmt: skip
    if status != 0:
        return None
    return y if flat else y.view(*x.shape[:-1], out_features)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] in 0..15 -> [out, in / 2] bytes, each 32 inputs as 16 bytes: input j in the low
    nibble of byte j, input j + 16 in its high one (GGUF's Q4 block layout)."""
    out_features, in_features = q.shape
    chunks = q.to(torch.uint8).view(out_features, in_features // 32, 2, 16)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(out_features, in_features // 2).contiguous()


def unpack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: [out, in / 2] bytes -> q [out, in] in 0..15 (uint8)."""
    out_features = nibbles.shape[0]
    chunks = nibbles.view(out_features, -1, 1, 16)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(out_features, -1)


def _int4_layout(nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> bool:
    """The tensors are what the 4-bit kernel reads (a module cast to another dtype casts its scales)."""
    return (
        nibbles.dtype == torch.uint8
        and scales.dtype == mins.dtype == torch.float32
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (nibbles, scales, mins))
    )


def int4_linear(
    x: torch.Tensor,
    nibbles: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """x [..., K] @ Wᵀ (+ bias) for W = q * scale + min in groups of `group` inputs (`pack_int4`'s
    nibbles; scales, mins [N, K / group] fp32), in x's dtype; None where the kernel does not run."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or not _int4_layout(nibbles, scales, mins) or not has_vector_kernels():
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return None
    out_features, in_features = nibbles.shape[0], nibbles.shape[1] * 2
    rows = x.reshape(-1, in_features).contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    status = library().pagoda_linear_int4(
        rows.data_ptr(), nibbles.data_ptr(), scales.data_ptr(), mins.data_ptr(), _ptr(bias), y.data_ptr(), rows.shape[0],
        out_features, in_features, group, DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return y.view(*x.shape[:-1], out_features) if status == 0 else None


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x [..., K] @ Wᵀ (+ bias) for W = q * scale (q [N, K] int8, scales [N], one per output) in x's dtype,
    for one row; None where the kernel does not run (the caller runs torch's)."""
    in_features = q.shape[1]
    if x.numel() != in_features or q.dtype != torch.int8 or not q.is_contiguous() or not has_vector_kernels():
        return None
    if _takes(x, scales, *([bias] if bias is not None else [])) is None or not scales.is_contiguous():
        return None
    row = x.contiguous()
    y = torch.empty(*x.shape[:-1], q.shape[0], dtype=x.dtype)
    status = library().pagoda_linear_int8(
        row.data_ptr(), q.data_ptr(), scales.data_ptr(), _ptr(bias), y.data_ptr(), 1, q.shape[0],
        in_features, DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return y if status == 0 else None


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


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [tokens, heads, head_dim] (heads side by side, rows at any stride) rotated in place by cos and
    sin [tokens, 1, head_dim], rounded where torch's ops round; False where the kernel does not take
    them (x untouched)."""
    lib = _takes(x, cos, sin)
    tokens, heads, head_dim = x.shape
    if (
        lib is None
        or x.stride(2) != 1
        or x.stride(1) != head_dim
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.numel() != tokens * head_dim
        or sin.numel() != tokens * head_dim
    ):
        return False
    status = lib.pagoda_rotary(x.data_ptr(), x.stride(0), tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                               DTYPES[x.dtype], torch.get_num_threads())  # fmt: skip
    return status == 0


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(each row's first maximal index, its logsumexp) of fp32 logits [rows, vocab], as torch's
    argmax and logsumexp give them; rows holding a NaN or an infinity take torch's own."""
    lib = _takes(logits)
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
        return None
    rows, vocab = logits.shape
    index = torch.empty(rows, dtype=torch.long)
    log_norm = torch.empty(rows)
    num_left = lib.pagoda_argmax_logsumexp(logits.data_ptr(), rows, vocab, index.data_ptr(),
                                           log_norm.data_ptr(), torch.get_num_threads())  # fmt: skip
    if num_left < 0:
        return None
    if num_left:
        left = (index < 0).nonzero().squeeze(1)
        index[left] = logits[left].argmax(dim=-1)
        log_norm[left] = torch.logsumexp(logits[left], dim=-1)
    return index, log_norm


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor | None:
    """Row i's token of softmax(logits[i] / temperatures[i]) at uniform[i] in [0, 1): the first whose
    cumulative probability exceeds uniform[i] x the row's total, as `sampler.sample_from_cdf` takes it
    (its choice at each draw but where the two sums round apart at a token's edge). None: the rows
    are the caller's (no kernel here, or a row holding a NaN or an infinite maximum)."""
    lib = _takes(logits)
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
        return None
    rows, vocab = logits.shape
    temps = temperatures.to(torch.float32).contiguous()
    draws = uniform.to(torch.float64).contiguous()
    index = torch.empty(rows, dtype=torch.long)
    left = lib.pagoda_sample_rows(logits.data_ptr(), DTYPES[logits.dtype], rows, vocab, temps.data_ptr(),
                                  draws.data_ptr(), index.data_ptr(), None, torch.get_num_threads())  # fmt: skip
    return index if left == 0 else None


def sample_plain(
    logits: torch.Tensor, temperatures: list[float], uniforms: list[float]
) -> tuple[list[int], list[float]] | None:
    """Each row's token (greedy where its temperature is 0, else `sample_rows`'s at its uniform draw) and
    that token's log-probability under the raw logits (fp32 or bf16, read as fp32), as lists, with no
    torch op around the kernel: after a decode step's weights have streamed through the caches, each
    small op costs tens of microseconds. None: the rows are the caller's (no kernel here, or a row
    holding a NaN or an infinite maximum)."""
    lib = _takes(logits)
    if lib is None or logits.dim() != 2 or not logits.is_contiguous():
        return None
    rows, vocab = logits.shape
    temps, draws = (ctypes.c_float * rows)(*temperatures), (ctypes.c_double * rows)(*uniforms)
    index, logprob = (ctypes.c_int64 * rows)(), (ctypes.c_float * rows)()
    threads = torch.get_num_threads()
    dtype = DTYPES[logits.dtype]
    if lib.pagoda_sample_rows(logits.data_ptr(), dtype, rows, vocab, temps, draws, index, logprob, threads):
        return None
    return list(index), list(logprob)


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


@dataclass(frozen=True)
class Projection:
    """A projection as the native kernels read it: the dense weight, and the 4-bit copy that runs
    instead for steps of up to `low_bit_rows` rows (`nibbles` None: that copy is not one these
    kernels read, so such steps are not theirs)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    low_bit_rows: int = 0
    nibbles: torch.Tensor | None = None  # `pack_int4`
    scales: torch.Tensor | None = None  # [N, K / group] fp32
    mins: torch.Tensor | None = None
    group: int = 0

    def kernel(self, rows: int, dtype: torch.dtype) -> int | None:
        """The native kernel for `rows` rows in `dtype` (None: torch's)."""
        if rows <= self.low_bit_rows:
            native = self.nibbles is not None and _int4_layout(self.nibbles, self.scales, self.mins)
            return LINEAR_INT4 if native else None
        return linear_kernel(self.weight, self.bias, rows, dtype)


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One Llama-family decoder layer's tensors as `DecodeLayers` reads them (q/k/v and gate/up
    stacked as the model holds them; no q/k norms)."""

    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    sliding_window: int | None

    def projections(self) -> tuple[Projection, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class _Projection(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("weight", "bias", "nibbles", "scales", "mins")] + [
        ("group", ctypes.c_int64),
        ("weight_dtype", ctypes.c_int64),
    ]

    def point_at(self, projection: Projection) -> None:
        self.weight, self.bias = projection.weight.data_ptr(), _ptr(projection.bias)
        self.nibbles, self.scales, self.mins = (_ptr(t) for t in (projection.nibbles, projection.scales, projection.mins))
        self.group = projection.group
        self.weight_dtype = DTYPES[projection.weight.dtype]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        *((name, _Projection) for name in ("qkv", "o", "gate_up", "down")),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("sliding_window", ctypes.c_int64),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int)
        for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "block_size",
                     "num_blocks", "dtype", "qkv_kernel", "o_kernel", "gate_up_kernel", "down_kernel")
    ] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]  # fmt: skip


class _PrefillPart(ctypes.Structure):
    _fields_ = [
        ("starts", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("block_table_stride", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
    ]


class BeyondRopeTables(LookupError):
    """A step's position is past the rotary tables `DecodeLayers` was given (nothing was written)."""


class DecodeLayers:
    """A model's decoder layers run as one native call per decode step (`pagoda_decode_layers`): the
    kernels the layers run op by op, in their order, so the result is theirs bit for bit. The weights'
    addresses are read once here; the tensors must stay where they are (loading copies into them)."""

    def __init__(
        self,
        layers: list[DecoderLayerWeights],
        final_norm: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
        scale: float,
    ) -> None:
        """`final_norm`: the weight of the model's norm after the layers (with the layers' `eps`)."""
        first = layers[0]
        self.weights = layers  # keeps the tensors the structs point at alive
        self.final_norm = final_norm
        self.dtype = first.input_norm.dtype
        hidden = first.input_norm.shape[0]
        self.shape = _Shape(
            hidden=hidden,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=first.o.weight.shape[1] // num_heads,
            intermediate=first.down.weight.shape[1],
            dtype=DTYPES[self.dtype],
            eps=eps,
            scale=scale,
        )
        self.structs = (_Layer * len(layers))()
        for struct, layer in zip(self.structs, layers, strict=True):
            for name, projection in zip(("qkv", "o", "gate_up", "down"), layer.projections(), strict=True):
                getattr(struct, name).point_at(projection)
            struct.input_norm, struct.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            struct.sliding_window = layer.sliding_window or 0
        self._kernels: dict[int, tuple[int, int, int, int] | None] = {}
        # The KV pool the structs point into: its list's id and its first tensor, weakly (a pool the
        # runner replaced must be freed), None before the first step; whether attention reads it as is.
        self._pool: tuple[int, weakref.ref] | None = None
        self._attention_takes_caches = False

    def kernels(self, rows: int) -> tuple[int, int, int, int] | None:
        """The native kernel of each projection at `rows` rows; None if another would run one."""
        if rows not in self._kernels:
            per_layer = {tuple(p.kernel(rows, self.dtype) for p in layer.projections()) for layer in self.weights}
            kernels = per_layer.pop() if len(per_layer) == 1 else None
            self._kernels[rows] = None if kernels is None or None in kernels else kernels
        return self._kernels[rows]

    def __call__(
        self,
        hidden: torch.Tensor,  # [rows, hidden]: the embeddings; becomes the output's final norm
        positions: torch.Tensor,  # [rows] int64
        rope_tables: tuple[torch.Tensor, torch.Tensor],  # cos, sin [table positions, 1, head_dim]
        slot_mapping: torch.Tensor,  # [rows] int64
        block_tables: torch.Tensor,  # [decode rows, max_blocks] int32
        context_lens: torch.Tensor,  # [decode rows] int32
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """The hidden states after every layer and the model's final norm, as the op-by-op forward gives
        them; None where the step is one these kernels do not take (the caller runs the layers). Each
        row's cos/sin are looked up in the tables in the call, not by torch ops before it; a position
        past them raises BeyondRopeTables (nothing written: grow them and call again).
        `prefill`: (cu_seqlens_q, context lengths, block tables) of the step's first rows, attended by the
        tiled prefill kernel (`prefill_attention`); each row after them is a decode query of
        `block_tables`/`context_lens`."""
        rows = hidden.shape[0]
        cos, sin = rope_tables
        kernels = self.kernels(rows)
        lib = library()
        if self._pool is None or self._pool[0] != id(kv_caches) or self._pool[1]() is not kv_caches[0][0]:
            self._point_at(kv_caches)
        if (
            kernels is None
            or hidden.dtype != self.dtype
            or not (hidden.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())
            or cos.dtype != self.dtype
            or sin.shape != cos.shape
            or positions.dtype != torch.int64
            or slot_mapping.dtype != torch.int64
            or not self._attention_takes_caches
        ):
            return None
        shape = self.shape
        shape.qkv_kernel, shape.o_kernel, shape.gate_up_kernel, shape.down_kernel = kernels
        tables, lens, slots = _int32(block_tables), _int32(context_lens), _contiguous(slot_mapping)
        positions = _contiguous(positions)
        part = None
        if prefill is not None:
            starts, prefill_lens, prefill_tables = (_int32(t) for t in prefill)
            part = _PrefillPart(starts.data_ptr(), prefill_lens.data_ptr(), prefill_tables.data_ptr(),
                                prefill_tables.stride(0), prefill_lens.shape[0])  # fmt: skip
        status = lib.pagoda_decode_layers(
            ctypes.byref(self.structs), len(self.structs), ctypes.byref(shape), hidden.data_ptr(), self.final_norm.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), cos.shape[0], slots.data_ptr(),
            None if part is None else ctypes.byref(part), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            rows, torch.get_num_threads(),
        )  # fmt: skip
        if status == -4:
            raise BeyondRopeTables(f"a position is past the {cos.shape[0]} of the rotary tables")
        if status in (-2, -3):
            raise IndexError("a block table entry or slot is outside the KV cache")
        if status != 0:
            raise RuntimeError(f"pagoda_decode_layers failed ({status})")
        return hidden

    def _point_at(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Once per KV pool, not per step: small work between two decode steps runs on the caches the
        weights' stream left (docs/kernels.md), where 60 pointers re-read cost a one-row step ~0.03 ms."""
        k_cache, v_cache = kv_caches[0]
        self._pool = (id(kv_caches), weakref.ref(k_cache))
        self._attention_takes_caches = k_cache.dtype == self.dtype and _attention_takes(
            library(), k_cache, v_cache, self.shape.num_heads
        )
        for struct, (k, v) in zip(self.structs, kv_caches, strict=True):
            struct.k_cache, struct.v_cache = k.data_ptr(), v.data_ptr()
        self.shape.num_blocks, self.shape.block_size = k_cache.shape[:2]


def _int32(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int32, without an op where it already is (the step's tables usually are)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()
