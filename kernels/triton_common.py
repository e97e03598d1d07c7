"""Small helpers shared by the Triton kernel launchers."""

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not be rounded to TF32 inside tl.dot (the 1e-3 accuracy bound forbids it)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2_at_least(n: int, minimum: int) -> int:
    """Power of two >= n and >= minimum (tl.arange needs powers of two, tl.dot tiles of >= 16)."""
    return max(minimum, triton.next_power_of_2(n))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal count elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 64


def upcast_dot(tensor: torch.Tensor) -> bool:
    """Whether tl.dot operands must be cast to fp32 first: Triton's interpreter (CPU tensors)
    multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584, unsupported upstream)."""
    return tensor.device.type != "cuda" and tensor.dtype == torch.bfloat16


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation; UPCAST computes it in fp32 (see `upcast_dot`)."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b, input_precision=PRECISION)
    return result


def check_launchable(tensor: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; CPU tensors need the interpreter, which Triton binds at
    import time. Fail with the fix instead of an opaque pointer error from the launcher."""
    from triton.runtime.interpreter import InterpretedFunction

    if tensor.device.type != "cuda" and not isinstance(dot, InterpretedFunction):
        raise RuntimeError(
            f"Triton kernels got {tensor.device.type} tensors: set TRITON_INTERPRET=1 before triton is "
            "first imported to run them on the CPU, or use --attention-backend torch"
        )
