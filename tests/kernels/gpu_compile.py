"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs kernels as numpy and accepts code the compiler rejects; this builds real cubins
with Triton's bundled ptxas, specialised the way a launch on real tensors would be (pointers and
strides divisible by 16, unit strides as constants), and reports registers, spills and whether the
loads are pipelined (cp.async) and the dots on tensor cores. Prints one JSON object per kernel.

Run as a script WITHOUT TRITON_INTERPRET (kernels are bound to the interpreter at import otherwise):
    python tests/kernels/gpu_compile.py
"""

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton
from pagoda.kernels import triton_decode, triton_prefill, triton_store_kv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
UNIT_STRIDES = {"stride_qd": 1, "stride_kd": 1, "stride_vd": 1}
# Llama-3-8B: head_dim 128, 4 query heads per KV head, 16-token blocks; bf16.
SHAPES = {
    "HEAD_DIM": 128,
    "HEAD_DIM_PAD": 128,
    "BLOCK_SIZE": 16,
    "DOT_PRECISION": "tf32",
    "UPCAST_DOT": False,
}


def compile_kernel(name: str, fn, pointers: dict[str, str], constants: dict, num_warps: int) -> dict:
    """Compile ``fn``; every non-constant, non-pointer argument is an i32 (fp32 for the scale)."""
    arg_names = fn.arg_names
    signature = {
        arg: "constexpr" if arg in constants else pointers.get(arg, "fp32" if arg == "scale_log2e" else "i32")
        for arg in arg_names
    }
    # Block tables' row stride is the table width: not necessarily a multiple of 16.
    divisible = [
        arg for arg in arg_names if arg in pointers or (arg.startswith("stride_") and arg != "stride_bt")
    ]
    attrs = {(arg_names.index(arg),): [["tt.divisibility", 16]] for arg in divisible if arg not in constants}
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs=constants, attrs=attrs),
        target=TARGET,
        options={"num_warps": num_warps},
    )
    ptx = kernel.asm["ptx"]
    result = {
        "kernel": name,
        "shared_bytes": kernel.metadata.shared,
        "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
        "tensor_core_ops": len(re.findall(r"wgmma\.mma_async|mma\.sync", ptx)),
    }
    if CUOBJDUMP.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            usage = subprocess.run(
                [str(CUOBJDUMP), "-res-usage", cubin.name], capture_output=True, text=True
            ).stdout
        registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
        result.update(registers=int(registers), spill_stack_bytes=int(stack))
    return result


def main() -> None:
    bf16 = "*bf16"
    common_ptrs = {"out_ptr": bf16, "q_ptr": bf16, "k_cache_ptr": bf16, "v_cache_ptr": bf16,
                   "block_tables_ptr": "*i32", "context_lens_ptr": "*i32"}  # fmt: skip
    decode_ptrs = {**common_ptrs, "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
    for split in (False, True):
        constants = {**UNIT_STRIDES, **SHAPES, "GROUP": 4, "GROUP_PAD": 16, "BLOCK_N": 64, "USE_WINDOW": split,
                     "SPLIT": split}  # fmt: skip
        print(json.dumps(compile_kernel(f"decode split={split}", triton_decode._decode_kernel, decode_ptrs,
                                        constants, num_warps=4)))  # fmt: skip
    reduce_ptrs = {"out_ptr": bf16, "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
    constants = {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "PARTITIONS_PAD": 8}
    print(
        json.dumps(compile_kernel("decode reduce", triton_decode._reduce_kernel, reduce_ptrs, constants, 4))
    )
    prefill_ptrs = {**common_ptrs, "cu_seqlens_q_ptr": "*i32"}
    constants = {**UNIT_STRIDES, **SHAPES, "GROUP": 4, "BLOCK_M": 64, "BLOCK_N": 64, "USE_WINDOW": False}
    print(json.dumps(compile_kernel("prefill", triton_prefill._prefill_kernel, prefill_ptrs, constants, 4)))
    store_ptrs = {
        "key_ptr": bf16,
        "value_ptr": bf16,
        "k_cache_ptr": bf16,
        "v_cache_ptr": bf16,
        "slot_mapping_ptr": "*i64",
    }
    constants = {"stride_kd": 1, "stride_vd": 1, "stride_kcd": 1, "stride_vcd": 1, "NUM_KV_HEADS": 8, "HEAD_DIM": 128,
                 "KV_HEADS_PAD": 8, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16}  # fmt: skip
    print(json.dumps(compile_kernel("store_kv", triton_store_kv._store_kv_kernel, store_ptrs, constants, 4)))


if __name__ == "__main__":
    main()
