"""Check the Triton kernels against the torch reference at realistic sizes, then time them.

One command on a GPU machine (from the repo root; no install needed):

    python kernels/bench.py --out OUT_DIR          # or: python -m pagoda.kernels.bench --out OUT_DIR

Shapes are Llama-3-8B's (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks). Each kernel
is first checked against the reference on fresh random inputs (a few sequences of each batch: the
kernels treat sequences independently), then timed with `triton.testing.do_bench` (median) and
compared with the device's own measured copy bandwidth and bf16 matmul rate. Last, an engine decode
step is timed end to end on a random-weight 1B-class Llama (skipped when the engine is unavailable).
Writes ``bench.json`` and ``bench.md`` to ``--out``.

``TRITON_INTERPRET=1 python kernels/bench.py --smoke`` runs the correctness part at tiny sizes on CPU.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

# Llama-3-8B attention shapes.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (512, 4096, 32768)
# (sequences, new tokens per sequence, context per sequence): whole prompts, then chunked prefills
# after a long cached prefix.
# The target (>= 70% of copy bandwidth on an H200), and the variants timed on it.
DECODE_TARGET = (64, 4096)
DECODE_SWEEP = ((32, 1), (128, 1), (64, 4), (64, 8), (128, 4))
# Prefill tiles (BLOCK_M, BLOCK_N) timed on one 4k prompt.
PREFILL_TARGET = (1, 4096, 4096)
PREFILL_SWEEP = ((128, 64), (128, 128), (64, 32))
PREFILL_CASES = ((1, 512, 512), (1, 4096, 4096), (8, 2048, 2048), (1, 16384, 16384), (1, 2048, 32768))
STORE_TOKENS = (256, 8192)
# Decode/prefill on a cache with NaN in every unowned slot and a shared first block.
POISONED_LENS = [20, 33, 1000, 5000]
CHECKED_SEQS = 4  # sequences of each batch compared with the reference
CHECKED_ROWS = 512  # last query rows of each prefill sequence compared with the reference
# One 1B-class Llama (Llama-3.2-1B's shape) for the engine decode step.
ENGINE_MODEL = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
ENGINE_BATCHES = (1, 32, 128)
# A small Llama for the engine's Triton-vs-torch greedy check (GQA 4, head_dim 64).
CHECK_MODEL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=1024,
)
CHECK_TOKENS = 16
ENGINE_PROMPT, ENGINE_STEPS = 512, 32


@dataclass
class Report:
    device: str
    versions: dict
    copy_gbps: float | None = None
    matmul_tflops: float | None = None
    checks: list = field(default_factory=list)
    timings: list = field(default_factory=list)
    engine: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check["ok"] for check in self.checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench.json, bench.md")
    parser.add_argument("--smoke", action="store_true", help="tiny correctness checks only (CPU interpreter)")
    parser.add_argument("--no-engine", action="store_true", help="skip the end-to-end engine decode step")
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            parser.error("no CUDA device: only --smoke runs here (under TRITON_INTERPRET=1)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import triton

    device = torch.device("cuda" if cuda else "cpu")
    report = Report(
        device=torch.cuda.get_device_name(device)
        if cuda
        else f"cpu (Triton interpreter), {platform.machine()}",
        versions={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
    )
    started = time.monotonic()

    def checkpoint() -> None:
        write_report(report, args.out)
        print(
            f"[{time.monotonic() - started:5.0f} s] {len(report.checks)} checks "
            f"({sum(not c['ok'] for c in report.checks)} failed), {len(report.timings)} timings",
            flush=True,
        )

    try:
        if args.smoke:
            run_smoke(report, device)
        else:
            run_full(report, device, engine=not args.no_engine, checkpoint=checkpoint)
    except Exception:  # a one-shot GPU run still leaves everything measured so far, and why it stopped
        report.notes.append("CRASHED:\n```\n" + traceback.format_exc() + "```")
        report.checks.append(
            {"kernel": "bench", "case": "crashed (see notes)", "rel_err": float("nan"), "ok": False}
        )
    report.notes.append(f"total wall time {time.monotonic() - started:.0f} s")
    write_report(report, args.out)
    print(markdown(report))
    return 0 if report.passed else 1


# ---- inputs -------------------------------------------------------------------------------------


def uniform_paged_cache(batch: int, context: int, dtype, device, generator):
    """A random cache holding ``batch`` sequences of ``context`` tokens in shuffled physical blocks,
    built on the device (the CPU builder in `pagoda.kernels.testing` is too slow at these sizes)."""
    import torch
    from pagoda.kernels.testing import PagedKV

    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=generator, device=device)[: batch * blocks_per_seq]
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return PagedKV(k_cache, v_cache, tables, lens)


def checked_rows(batch: int) -> list[int]:
    return sorted({0, batch // 3, (2 * batch) // 3, batch - 1})[:CHECKED_SEQS]


# ---- checks ---------------------------------------------------------------------------------------


def check_decode(report, name, backend, cache, query, sliding_window=None, rows=None) -> None:
    from pagoda.kernels.reference import TorchReferenceBackend
    from pagoda.kernels.testing import relative_error, tolerance

    scale = query.shape[-1] ** -0.5
    out = backend.paged_decode_attention(
        query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale, sliding_window
    )
    rows = list(range(query.shape[0])) if rows is None else rows
    expected = TorchReferenceBackend().paged_decode_attention(
        query[rows],
        cache.k_cache,
        cache.v_cache,
        cache.block_tables[rows],
        cache.context_lens[rows],
        scale,
        sliding_window,
    )
    error = relative_error(out[rows], expected)
    report.checks.append(
        {"kernel": "decode", "case": name, "rel_err": error, "ok": error <= tolerance(query.dtype)}
    )


def check_prefill(report, name, backend, cache, query, cu_seqlens_q, sliding_window=None) -> None:
    """Compares the last CHECKED_ROWS query rows of each sequence: as the newest tokens of the same
    context they are a valid prefill on their own, and keep the reference's score matrix small."""
    import torch
    from pagoda.kernels.reference import TorchReferenceBackend
    from pagoda.kernels.testing import relative_error, tolerance

    scale = query.shape[-1] ** -0.5
    out = backend.paged_prefill_attention(
        query,
        cache.k_cache,
        cache.v_cache,
        cu_seqlens_q,
        cache.context_lens,
        cache.block_tables,
        scale,
        sliding_window,
    )
    ends = cu_seqlens_q[1:].tolist()
    starts = [
        max(begin, end - CHECKED_ROWS) for begin, end in zip(cu_seqlens_q[:-1].tolist(), ends, strict=True)
    ]
    index = torch.cat([torch.arange(s, e, device=query.device) for s, e in zip(starts, ends, strict=True)])
    counts = torch.tensor([e - s for s, e in zip(starts, ends, strict=True)], device=query.device)
    sub_cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    expected = TorchReferenceBackend().paged_prefill_attention(
        query[index],
        cache.k_cache,
        cache.v_cache,
        sub_cu,
        cache.context_lens,
        cache.block_tables,
        scale,
        sliding_window,
    )
    error = relative_error(out[index], expected)
    report.checks.append(
        {"kernel": "prefill", "case": name, "rel_err": error, "ok": error <= tolerance(query.dtype)}
    )


def check_store(report, name, backend, num_tokens, dtype, device, generator) -> None:
    import torch
    from pagoda.kernels.reference import TorchReferenceBackend

    cache = uniform_paged_cache(1, num_tokens * 2, dtype, device, generator)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator, device=device, dtype=dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(cache.k_cache.shape[0] * BLOCK_SIZE, generator=generator, device=device)[
        :num_tokens
    ]
    slots[::7] = -1
    k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
    TorchReferenceBackend().store_kv(key, value, k_ref, v_ref, slots)
    backend.store_kv(key, value, cache.k_cache, cache.v_cache, slots)
    ok = torch.equal(k_ref, cache.k_cache) and torch.equal(v_ref, cache.v_cache)
    report.checks.append({"kernel": "store_kv", "case": name, "rel_err": 0.0 if ok else 1.0, "ok": ok})


def check_poisoned(report, backend, device, dtype, context_lens: list[int]) -> None:
    """Very different lengths, NaN in every slot no sequence owns, shared prefix blocks."""
    import torch
    from pagoda.kernels.testing import make_paged_kv, random_queries

    cpu_gen = torch.Generator().manual_seed(1)  # the builder draws on the CPU
    cache = make_paged_kv(
        context_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, device, shared_blocks=1, generator=cpu_gen
    )
    lens = "/".join(map(str, context_lens))
    query = random_queries(len(context_lens), NUM_HEADS, HEAD_DIM, dtype, device, cpu_gen)
    check_decode(report, f"NaN-poisoned, shared blocks, lens {lens}", backend, cache, query)
    q_lens = torch.tensor([min(n, 300) for n in context_lens])
    cu = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32).to(device)
    query = random_queries(int(q_lens.sum()), NUM_HEADS, HEAD_DIM, dtype, device, cpu_gen)
    check_prefill(report, f"NaN-poisoned, shared blocks, lens {lens}", backend, cache, query, cu)
    check_prefill(
        report, f"NaN-poisoned, window 128, lens {lens}", backend, cache, query, cu, sliding_window=128
    )


# ---- the two modes --------------------------------------------------------------------------------


def run_smoke(report: Report, device) -> None:
    """Tiny shapes: every kernel path checked, nothing timed."""
    import torch
    from pagoda.kernels.testing import make_paged_kv, random_queries
    from pagoda.kernels.triton_backend import TritonBackend

    generator = torch.Generator().manual_seed(0)
    single = TritonBackend(decode_block_n=16, decode_partitions=1, prefill_block_m=16, prefill_block_n=16)
    split = TritonBackend(decode_block_n=16, decode_partitions=3)
    for dtype in (torch.float32, torch.bfloat16):
        cache = make_paged_kv([3, 40, 75], 2, 32, 8, dtype, shared_blocks=0, generator=generator)
        query = random_queries(3, 8, 32, dtype, generator=generator)
        check_decode(report, f"{dtype}, split 1", single, cache, query)
        check_decode(report, f"{dtype}, split 3", split, cache, query)
        check_decode(report, f"{dtype}, split 3, window 20", split, cache, query, sliding_window=20)
        cu = torch.tensor([0, 3, 23, 33], dtype=torch.int32)
        query = random_queries(33, 8, 32, dtype, generator=generator)
        check_prefill(report, f"{dtype}, chunked", single, cache, query, cu)
        check_prefill(report, f"{dtype}, chunked, window 20", single, cache, query, cu, sliding_window=20)
        check_store(report, f"{dtype}, 6 tokens", single, 6, dtype, device, generator)
    report.notes.append("smoke mode: correctness only, at tiny sizes; nothing timed")


def run_full(report: Report, device, engine: bool, checkpoint=lambda: None) -> None:
    """`checkpoint()` after each section: a run killed at its time limit still leaves its numbers."""
    import torch
    import triton.testing
    from pagoda.kernels.triton_backend import TritonBackend
    from pagoda.kernels.triton_common import num_sms
    from pagoda.kernels.triton_decode import num_decode_partitions

    dtype = torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    backend = TritonBackend()
    no_split = TritonBackend(decode_partitions=1)

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3  # seconds

    report.copy_gbps = measure_copy_gbps(bench, device)
    report.matmul_tflops = measure_matmul_tflops(bench, device)
    element = torch.finfo(dtype).bits // 8
    torch.cuda.empty_cache()
    free_bytes = torch.cuda.mem_get_info(device)[0]

    check_poisoned(report, backend, device, dtype, POISONED_LENS)
    checkpoint()

    for tokens in STORE_TOKENS:
        check_store(report, f"{tokens} tokens", backend, tokens, dtype, device, generator)
        cache = uniform_paged_cache(1, tokens * 2, dtype, device, generator)
        key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator, device=device, dtype=dtype)
        slots = torch.randperm(tokens * 2, generator=generator, device=device)[:tokens]
        seconds = bench(lambda c=cache, k=key, s=slots: backend.store_kv(k, k, c.k_cache, c.v_cache, s))
        moved = 2 * 2 * key.numel() * element  # read and write, K and V
        report.timings.append(timing("store_kv", f"{tokens} tokens", seconds, moved, report))
        del cache, key
    checkpoint()

    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * element
            if kv_bytes > 0.6 * free_bytes:
                report.notes.append(f"decode batch {batch} x {context}: skipped, KV cache would not fit")
                continue
            cache = uniform_paged_cache(batch, context, dtype, device, generator)
            query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator, device=device, dtype=dtype)
            name = f"batch {batch} x ctx {context}"
            rows = checked_rows(batch)
            check_decode(report, name, backend, cache, query, rows=rows)
            parts = num_decode_partitions(
                batch, NUM_KV_HEADS, context, backend.decode_min_partition_size, num_sms(device)
            )
            variants = [(backend, f"split {parts} (heuristic)")]
            if parts > 1:
                check_decode(report, f"{name}, no split", no_split, cache, query, rows=rows)
                variants.append((no_split, "split 1 (forced)"))
            args = (
                query,
                cache.k_cache,
                cache.v_cache,
                cache.block_tables,
                cache.context_lens,
                HEAD_DIM**-0.5,
            )
            for variant, label in variants:
                seconds = bench(lambda v=variant, a=args: v.paged_decode_attention(*a))
                report.timings.append(timing("decode", f"{name}, {label}", seconds, kv_bytes, report))
            del cache, query, args
        checkpoint()

    sweep_decode(report, bench, device, dtype, generator)
    checkpoint()

    for seqs, q_len, context in PREFILL_CASES:
        time_prefill(report, bench, device, dtype, generator, backend, seqs, q_len, context)
        checkpoint()
    sweep_prefill(report, bench, device, dtype, generator)
    checkpoint()

    if engine:
        torch.cuda.empty_cache()
        try:
            check_engine_greedy(report, device)
            checkpoint()
            time_engine_decode(report, device)
        except Exception:  # the engine is another team's code: its failure must not hide the kernels'
            report.notes.append("engine FAILED:\n```\n" + traceback.format_exc() + "```")


def sweep_decode(report: Report, bench, device, dtype, generator) -> None:
    """The issue's target case under other tile sizes and split counts, to tune the defaults from."""
    import torch
    from pagoda.kernels.triton_backend import TritonBackend

    batch, context = DECODE_TARGET
    cache = uniform_paged_cache(batch, context, dtype, device, generator)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator, device=device, dtype=dtype)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, HEAD_DIM**-0.5)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * query.element_size()
    for block_n, parts in DECODE_SWEEP:
        variant = TritonBackend(decode_block_n=block_n, decode_partitions=parts)
        name = f"batch {batch} x ctx {context}, sweep: tile {block_n}, split {parts}"
        check_decode(report, name, variant, cache, query, rows=checked_rows(batch))
        seconds = bench(lambda v=variant: v.paged_decode_attention(*args))
        report.timings.append(timing("decode", name, seconds, kv_bytes, report))


def sweep_prefill(report: Report, bench, device, dtype, generator) -> None:
    """One prompt under other tile shapes, to tune the prefill defaults from."""
    import torch
    from pagoda.kernels.triton_backend import TritonBackend

    for block_m, block_n in PREFILL_SWEEP:
        variant = TritonBackend(prefill_block_m=block_m, prefill_block_n=block_n)
        time_prefill(report, bench, device, dtype, generator, variant, *PREFILL_TARGET,
                     label=f", sweep: tiles {block_m}x{block_n}")  # fmt: skip
    torch.cuda.empty_cache()


def time_prefill(report, bench, device, dtype, generator, backend, seqs, q_len, context, label="") -> None:
    import torch

    element = torch.finfo(dtype).bits // 8
    cache = uniform_paged_cache(seqs, context, dtype, device, generator)
    query = torch.randn(seqs * q_len, NUM_HEADS, HEAD_DIM, generator=generator, device=device, dtype=dtype)
    cu = torch.arange(0, seqs + 1, device=device, dtype=torch.int32) * q_len
    name = f"{seqs} x {q_len} new" + ("" if q_len == context else f" after {context - q_len} cached") + label
    check_prefill(report, name, backend, cache, query, cu)
    seconds = bench(
        lambda: backend.paged_prefill_attention(
            query, cache.k_cache, cache.v_cache, cu, cache.context_lens, cache.block_tables, HEAD_DIM**-0.5
        )
    )
    pairs = seqs * (q_len * context - q_len * (q_len - 1) // 2)  # causal (query, key) pairs
    flops = 4 * HEAD_DIM * NUM_HEADS * pairs
    moved = 2 * seqs * context * NUM_KV_HEADS * HEAD_DIM * element + 2 * query.numel() * element
    report.timings.append(timing("prefill", name, seconds, moved, report, flops=flops))


def timing(
    kernel: str, case: str, seconds: float, moved: int, report: Report, flops: int | None = None
) -> dict:
    gbps = moved / seconds / 1e9
    row = {
        "kernel": kernel,
        "case": case,
        "us": seconds * 1e6,
        "gbps": gbps,
        "pct_copy": 100 * gbps / report.copy_gbps,
    }
    if flops is not None:
        tflops = flops / seconds / 1e12
        row.update(tflops=tflops, pct_matmul=100 * tflops / report.matmul_tflops)
    return row


def measure_copy_gbps(bench, device) -> float:
    """Device copy bandwidth: a 2 GiB `copy_` (every byte read once and written once)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def measure_matmul_tflops(bench, device) -> float:
    import torch

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = bench(lambda: a @ b)
    return 2 * n**3 / seconds / 1e12


# ---- end to end -----------------------------------------------------------------------------------


def check_engine_greedy(report: Report, device) -> None:
    """The engine end to end on the device: greedy tokens on the Triton path equal the torch path's
    (fp32, a small random Llama; chunked prefill and a prefix-cache hit included)."""
    import torch
    from pagoda.server.engine.llm import LLM
    from pagoda.server.engine.loader import load_model
    from pagoda.server.engine.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(1)

    def random_ids(n: int) -> list[int]:
        return torch.randint(3, CHECK_MODEL["vocab_size"], (n,), generator=generator).tolist()

    shared = random_ids(40)
    prompts = [shared + random_ids(n) for n in (1, 7, 33, 90)] + [random_ids(5), random_ids(200)]
    params = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    tokens = {}
    with tempfile.TemporaryDirectory() as folder:
        save_random_llama(Path(folder), device, CHECK_MODEL, torch.float32)
        for backend in ("torch", "triton"):
            with mock.patch.dict(os.environ, {"PAGODA_ATTENTION_BACKEND": backend}):
                loaded = load_model(folder, dtype="float32", device=device)  # layers pick their backend
                llm = LLM(loaded=loaded, device=str(device), block_size=BLOCK_SIZE,
                          max_num_batched_tokens=64, num_blocks=256)  # fmt: skip
                llm.generate(prompts[:1], params)  # caches the shared prefix for the others
                tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
                del llm, loaded
    differing = sum(a != b for a, b in zip(tokens["torch"], tokens["triton"], strict=True))
    report.checks.append(
        {
            "kernel": "engine",
            "case": f"greedy tokens, triton vs torch path (fp32, {len(prompts)} prompts x {CHECK_TOKENS})",
            "rel_err": differing / len(prompts),  # the share of prompts whose tokens differ
            "ok": differing == 0,
        }
    )


def time_engine_decode(report: Report, device) -> None:
    """Median engine step time once every sequence is decoding, on a random-weight 1B-class Llama."""
    try:
        import tokenizers  # noqa: F401  (the random model's tokenizer)
        import transformers  # noqa: F401
        from pagoda.server.engine.config import EngineArgs
        from pagoda.server.engine.llm_engine import LLMEngine
        from pagoda.server.engine.loader import load_model
        from pagoda.server.engine.sampling_params import SamplingParams
    except ImportError as error:
        report.notes.append(f"engine decode step: skipped, engine not importable ({error})")
        return
    import torch

    with tempfile.TemporaryDirectory() as folder:
        save_random_llama(Path(folder), device)
        loaded = load_model(folder, dtype="bfloat16", device=device)
        # The pool sizing a server does at start (on CUDA: a profiling forward of a full step).
        sized = LLMEngine(
            EngineArgs(model=folder, dtype="bfloat16", device=str(device), gpu_memory_utilization=0.5,
                       kv_cache_memory=64 << 20, seed=0),
            loaded=loaded,
        )  # fmt: skip
        pool = sized.block_manager
        report.notes.append(
            f"engine KV pool sized at gpu_memory_utilization 0.5: {pool.num_blocks} blocks of "
            f"{pool.block_size} tokens ({pool.num_blocks * pool.block_size} tokens, "
            f"{pool.num_blocks * sized.spec.bytes_per_block / 2**30:.2f} GiB)"
        )
        del sized, pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for batch in ENGINE_BATCHES:
            blocks = batch * (-(-(ENGINE_PROMPT + ENGINE_STEPS + 1) // BLOCK_SIZE)) + 8
            engine = LLMEngine(
                EngineArgs(
                    model=folder,
                    dtype="bfloat16",
                    device=str(device),
                    block_size=BLOCK_SIZE,
                    max_num_seqs=batch,
                    num_blocks=blocks,
                    enable_prefix_caching=False,
                    seed=0,
                ),
                loaded=loaded,
            )
            params = SamplingParams(max_tokens=ENGINE_STEPS, temperature=0.0, ignore_eos=True)
            prompt_gen = torch.Generator().manual_seed(batch)
            for i in range(batch):
                prompt = torch.randint(engine.vocab_size, (ENGINE_PROMPT,), generator=prompt_gen).tolist()
                engine.add_request(f"bench-{i}", prompt, params)
            produced: dict[str, int] = {}
            step_seconds = []
            while engine.has_unfinished():
                decoding = len(produced) == batch and all(n >= 1 for n in produced.values())
                start = time.perf_counter()
                outputs = engine.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if decoding:
                    step_seconds.append(time.perf_counter() - start)
                for output in outputs:  # deltas: the tokens new this step
                    produced[output.request_id] = produced.get(output.request_id, 0) + len(output.outputs[0].token_ids)
            step_seconds.sort()
            median = step_seconds[len(step_seconds) // 2] if step_seconds else float("nan")
            report.engine.append(
                {
                    "batch": batch,
                    "context": ENGINE_PROMPT,
                    "decode_steps": len(step_seconds),
                    "step_ms": median * 1e3,
                    "tokens_per_s": batch / median,
                }
            )
            del engine
            torch.cuda.empty_cache()


def save_random_llama(folder: Path, device, shape: dict | None = None, dtype=None) -> None:
    """A random-weight Llama HF folder (default: Llama-3.2-1B-shaped, bf16) with a local word-level
    tokenizer over the whole vocabulary (any sampled id decodes)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**(shape or ENGINE_MODEL), bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):  # random init is slow on the CPU for 1B parameters
        model = LlamaForCausalLM(config).to(dtype or torch.bfloat16)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="t0", eos_token="t1", unk_token="t2"
    ).save_pretrained(folder)


# ---- output ---------------------------------------------------------------------------------------


def markdown(report: Report) -> str:
    lines = [f"Device: {report.device} · " + ", ".join(f"{k} {v}" for k, v in report.versions.items())]
    if report.copy_gbps:
        lines.append(
            f"Measured copy bandwidth {report.copy_gbps:.0f} GB/s · bf16 matmul {report.matmul_tflops:.0f} TFLOP/s"
        )
    lines += ["", "| kernel | case | rel. error | ok |", "|---|---|---|---|"]
    lines += [
        f"| {c['kernel']} | {c['case']} | {c['rel_err']:.2e} | {'yes' if c['ok'] else '**NO**'} |"
        for c in report.checks
    ]
    if report.timings:
        lines += [
            "",
            "| kernel | case | median µs | GB/s | % copy BW | TFLOP/s | % matmul |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in report.timings:
            compute = f"{t['tflops']:.1f} | {t['pct_matmul']:.0f}%" if "tflops" in t else "– | –"
            lines.append(
                f"| {t['kernel']} | {t['case']} | {t['us']:.1f} | {t['gbps']:.0f} | {t['pct_copy']:.0f}% | {compute} |"
            )
    if report.engine:
        lines += ["", "| engine decode step | context | median ms | tokens/s |", "|---|---|---|---|"]
        lines += [
            f"| batch {e['batch']} | {e['context']} | {e['step_ms']:.2f} | {e['tokens_per_s']:.0f} |"
            for e in report.engine
        ]
    lines += [""] + [f"- {note}" for note in report.notes]
    return "\n".join(lines)


def write_report(report: Report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=2))
    (out / "bench.md").write_text(markdown(report) + "\n")


def _install_repo_shim() -> None:
    """Run as ``python kernels/bench.py``: import ``pagoda.*`` from this checkout, installed or not."""
    import importlib.util

    repo = Path(__file__).resolve().parent.parent
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # kernels/ is no top level
    for name, folder in (("pagoda", "pagoda"), ("pagoda.kernels", "kernels"), ("pagoda.server", "server")):
        path = repo / folder
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        if "." in name:
            setattr(sys.modules["pagoda"], name.split(".", 1)[1], module)


if __name__ == "__main__":
    if not __package__:
        _install_repo_shim()
    sys.exit(main())
