"""Engine configuration: `EngineArgs`, one field per `pagoda serve/generate/bench` flag.

Every flag also reads its default from the environment variable ``PAGODA_<FLAG>`` (dashes become
underscores, e.g. ``PAGODA_BLOCK_SIZE``), so the operator can configure pods with env vars only.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, fields

ENV_PREFIX = "PAGODA_"
QUANTIZATIONS = ("auto", "none", "gguf", "int4")  # what each means: --quantization's help

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_bytes(value: str | int) -> int:
    """'2GiB', '512MiB', '80GB', '1e9' or an int → bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {value!r} (use e.g. 2GiB, 512MiB, 80GB or a number)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class EngineArgs:
    model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None  # None = the model's own
    dtype: str = "auto"  # auto = bfloat16 on CUDA and on CPUs with native bf16, else float32
    device: str = "auto"  # auto = cuda if available, else cpu
    quantization: str = "auto"  # auto = a GGUF model's own 4-bit weights on CPU, else dense; int4: 4-bit copies
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = 2048 (chunked prefill) or max_model_len
    max_model_len: int | None = None  # None = the model's
    kv_cache_memory: int | None = None  # bytes, CPU (None = a share of free RAM, capped at 2 GiB)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    cpu_threads: int | None = None  # None = the cores this process may use (affinity, cgroup limit)
    num_blocks: int | None = None  # override the pool size (tests use tiny pools)
    attention_backend: str = "auto"  # auto = Triton on CUDA, the fused CPU backend on CPU; torch = the reference
    enforce_eager: bool = False  # CUDA: no graphs of decode steps, every step launched op by op
    tensor_parallel_size: int = 1  # ranks the model is split over (parallel/)
    nnodes: int = 1  # nodes those ranks span (a LeaderWorkerSet group); this process is node 0

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("engine")

        def env(name: str, default):
            return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)

        def add(flag: str, **kw):
            # every default is the field's own: the dataclass above is the one definition
            default = DEFAULTS[flag.replace("-", "_")]
            group.add_argument(f"--{flag}", default=env(flag, default), **kw)

        add("model", help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
        add("tokenizer", help="tokenizer folder (default: the model's)")
        add(
            "dtype",
            choices=["auto", "float32", "bfloat16", "float16"],
            help="weights/KV dtype (auto: bfloat16 on CUDA and on CPUs with native bf16, else float32)",
        )
        add("device", help="auto, cpu, cuda, cuda:N")
        add(
            "quantization",
            choices=QUANTIZATIONS,
            help="low-bit weight copies for one-row CPU steps. gguf: a GGUF model's own Q4_0/Q4_1 blocks "
            "(and an int8 copy of a Q8_0 LM head); int4: 4-bit groups of 32 made from the dense weights "
            "(any model, e.g. an HF folder) and an int8 LM head; none: dense weights only; "
            "auto: gguf for a GGUF model on CPU, else none",
        )
        add("block-size", type=int, help="tokens per KV block")
        add("max-num-seqs", type=int, help="max sequences in the running batch")
        add("max-num-batched-tokens", type=int, help="max tokens per engine step")
        add("max-model-len", type=int, help="max prompt + output tokens (default: the model's)")
        add("kv-cache-memory", type=parse_bytes, help="KV pool size on CPU, e.g. 2GiB")
        add("gpu-memory-utilization", type=float, help="share of GPU memory to use")
        add("num-blocks", type=int, help="force the number of KV blocks (overrides memory sizing)")
        add(
            "attention-backend",
            choices=["auto", "cpu", "torch", "triton"],
            help="attention kernels (auto: triton on CUDA, cpu on CPU; torch: the op-by-op reference)",
        )
        add("seed", type=int, help="seed for requests without their own seed")
        add(
            "tensor-parallel-size",
            type=int,
            help="split the model over this many ranks (GPUs, or CPU processes), one process each",
        )
        add("nnodes", type=int, help="nodes the tensor-parallel ranks span (default 1)")
        add(
            "cpu-threads",
            type=int,
            help="torch threads on CPU (default: the cores this process may use, within its CPU limit)",
        )
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=env_bool(env("enable-prefix-caching", None), DEFAULTS["enable_prefix_caching"]),
            help="reuse cached KV blocks of shared prompt prefixes (--no-prefix-caching turns it off)",
        )
        group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
        group.add_argument(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=env_bool(env("enable-chunked-prefill", None), DEFAULTS["enable_chunked_prefill"]),
            help="prefill long prompts in chunks within the per-step token budget",
        )
        group.add_argument(
            "--enforce-eager",
            action="store_true",
            default=env_bool(env("enforce-eager", None), DEFAULTS["enforce_eager"]),
            help="CUDA: launch every step op by op instead of replaying captured decode graphs "
            "(saves the graphs' capture time and memory; decode steps run slower)",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        # argparse already converted env-var string defaults through each flag's `type`.
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**values)


DEFAULTS = {f.name: f.default for f in fields(EngineArgs)}


def env_bool(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")
