"""Tensor parallelism on CPU (gloo): two ranks give the tokens of one, and logits within 1e-5.

Each TP=2 engine starts a real worker process (`parallel/worker.py`) that loads its own shard from
the safetensors; the TP=1 reference is the plain engine on the same folder. Every step's logits are
recorded on both and compared row by row, so a wrong shard or a missing all-reduce shows at once.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.server.engine.llm import LLM
from pagoda.server.engine.sampling_params import SamplingParams
from support.tiny_models import tiny_model_dir

PROMPTS = [[7, 8, 9, 10, 11], list(range(5, 40)), [30, 31, 32]]
LOGITS_TOL = 1e-5


def engine_on(folder, tp: int, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLM(str(folder), device="cpu", dtype="float32", tensor_parallel_size=tp, block_size=8, **kw)


def record_logits(llm: LLM) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    execute = llm.engine.runner.execute

    def recording(out):
        logits, sampled = execute(out)
        seen.append(logits.clone())
        return logits, sampled

    llm.engine.runner.execute = recording
    return seen


def run_both(folder, prompts, params, *, warm_up=None, sizes=(1, 2), **kw):
    """Per TP size 1 and 2: (outputs, per-step logits, stats, rank 0's KV caches). `warm_up`
    prompts run first, to completion (their blocks stay in the prefix cache)."""
    results = []
    for tp in sizes:
        llm = engine_on(folder, tp, **kw)
        try:
            logits = record_logits(llm)
            if warm_up:
                llm.generate(warm_up, params[0])
            outputs = llm.generate(prompts, params)
            assert llm.engine.block_manager.num_used_blocks == 0
            results.append((outputs, logits, llm.engine.stats(), llm.engine.runner.kv_caches))
        finally:
            llm.engine.shutdown()
    return results


def assert_same(one, two) -> None:
    (out1, logits1, _, _), (out2, logits2, _, _) = one, two
    for a, b in zip(out1, out2, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(logits1) == len(logits2)
    for step, (x, y) in enumerate(zip(logits1, logits2, strict=True)):
        assert x.shape == y.shape, step
        if x.numel():
            assert (x - y).abs().max().item() < LOGITS_TOL, step


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_mha_greedy_tokens_and_logits_equal_one_rank(tmp_path_factory):
    """llama: MHA, untied head; rank 0's KV cache holds exactly its two heads of the four."""
    folder = tiny_model_dir("llama", tmp_path_factory)
    one, two = run_both(folder, PROMPTS, GREEDY)
    assert_same(one, two)
    (k1, v1), (k2, v2) = one[3][0], two[3][0]  # layer 0, same block tables on both
    assert k2.shape[2] == k1.shape[2] // 2
    assert torch.allclose(k2, k1[:, :, :2], atol=1e-5) and torch.allclose(v2, v1[:, :, :2], atol=1e-5)


def test_one_kv_head_is_replicated_on_both_ranks(tmp_path_factory):
    """Multi-query attention (1 KV head < 2 ranks): each rank holds the one KV head, whole."""
    folder = tiny_model_dir("qwen2", tmp_path_factory, num_kv_heads=1)
    one, two = run_both(folder, PROMPTS, GREEDY)
    assert_same(one, two)
    assert two[3][0][0].shape[1:] == one[3][0][0].shape[1:]  # the KV head is not split


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3"])
def test_gqa_families_greedy_tokens_and_logits_equal_one_rank(tmp_path_factory, family):
    """GQA with 2 KV heads on 2 ranks (kv_heads < 2·ranks: one KV head each), tied heads, biases,
    q/k norms, sliding windows."""
    one, two = run_both(tiny_model_dir(family, tmp_path_factory), PROMPTS, GREEDY)
    assert_same(one, two)


@pytest.mark.slow
def test_four_ranks_replicate_two_kv_heads(tmp_path_factory):
    """llama3 at TP=4: 4 query heads, 2 KV heads, so two ranks share each KV head."""
    one, four = run_both(tiny_model_dir("llama3", tmp_path_factory), PROMPTS, GREEDY, sizes=(1, 4))
    assert_same(one, four)
    assert four[3][0][0].shape[2] == 1


def test_n_beams_prefix_cache_and_preemption_under_two_ranks(tmp_path_factory):
    """A pool too small for the batch (preemption by recompute), shared prompt prefixes (prefix
    cache hits), n = 2 seeded sampling and beam search: the same outputs as one rank."""
    folder = tiny_model_dir("llama3", tmp_path_factory)
    shared = list(range(5, 29))  # three full 8-token blocks
    prompts = [[*shared, 40], [*shared, 41], [*shared, 42, 43], list(range(50, 70))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, n=2, use_beam_search=True, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    ]
    one, two = run_both(folder, prompts, params, warm_up=[[*shared, 39]], num_blocks=11, max_num_seqs=8)
    assert_same(one, two)
    stats = two[2]
    assert stats.preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.num_blocks_total == 11
    assert (stats.preemptions, stats.prefix_cache_hits) == (one[2].preemptions, one[2].prefix_cache_hits)


def plan(capsys, *argv: str) -> dict[str, str]:
    from pagoda.cli import main

    assert main(["plan", *argv]) == 0
    return dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())


def test_plan_reports_the_group_capacity(capsys, tmp_path_factory):
    """Two ranks on two GPUs of the same size hold twice the tokens (half the KV heads each); a KV
    head that is replicated holds no more, and the CPU budget is the group's."""
    folder = str(tiny_model_dir("llama", tmp_path_factory))
    gpu = ["--model", folder, "--gpu-memory", "64MiB", "--dtype", "float32"]
    one, two = plan(capsys, *gpu), plan(capsys, *gpu, "--tensor-parallel-size", "2")
    assert int(one["KV cache"].split()[0].replace(",", "")) == 2 * int(
        two["KV cache"].split()[0].replace(",", "")
    )
    tokens = [int(p["KV cache capacity"].split()[0].replace(",", "")) for p in (one, two)]
    assert tokens[1] >= 2 * tokens[0] > 0  # and the weights per rank halve too
    assert two["tensor parallelism"].startswith("2 ranks, 2 KV heads each")
    mqa = str(tiny_model_dir("qwen2", tmp_path_factory, num_kv_heads=1))
    cpu = ["--model", mqa, "--kv-cache-memory", "8MiB", "--dtype", "float32"]
    one, two = plan(capsys, *cpu), plan(capsys, *cpu, "--tensor-parallel-size", "2")
    assert two["KV cache"] == one["KV cache"]  # the one KV head is whole on each rank
    half = int(one["KV cache capacity"].split()[0].replace(",", "")) // 2
    assert int(two["KV cache capacity"].split()[0].replace(",", "")) == half


def test_low_bit_gguf_layers_stay_on_one_rank():
    """The 4-bit GGUF layers are not sharded: dense under TP for `auto`, a clear refusal for `gguf`."""
    from pathlib import Path

    from pagoda.server.engine.loader import ModelSource, resolve_quantization

    gguf = ModelSource("gguf", Path("m.gguf"), "m")
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", gguf, cpu, tp_size=1) == "gguf"
    assert resolve_quantization("auto", gguf, cpu, tp_size=2) == "none"
    with pytest.raises(ValueError, match="runs on one rank only"):
        resolve_quantization("gguf", gguf, cpu, tp_size=2)


def test_a_model_that_does_not_split_is_refused():
    from types import SimpleNamespace

    from pagoda.server.engine.parallel.sharding import check_shardable

    cfg = SimpleNamespace(num_heads=4, num_kv_heads=2, intermediate_size=128)
    check_shardable(cfg, 4)  # 2 KV heads on 4 ranks: replicated
    with pytest.raises(ValueError, match="4 attention heads"):
        check_shardable(cfg, 3)
    with pytest.raises(ValueError, match="6 KV heads"):
        check_shardable(SimpleNamespace(num_heads=12, num_kv_heads=6, intermediate_size=128), 4)


def test_each_rank_reads_only_its_slices_of_a_sharded_checkpoint(tmp_path_factory, monkeypatch):
    """Rank 1 of 2, built without a process group: its tensors are the checkpoint's slices, read with
    safetensors' get_slice (a whole-tensor read fails the test), across a multi-file checkpoint."""
    import safetensors
    from pagoda.server.engine.loader import load_model
    from pagoda.server.engine.parallel.group import TensorParallel

    folder = tiny_model_dir("qwen2", tmp_path_factory, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    full = load_model(folder, dtype="float32").model.checkpoint_targets()
    real_open = safetensors.safe_open

    class SlicesOnly:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            assert "proj" not in name and "embed" not in name, f"{name} read whole"
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", SlicesOnly)
    shard = load_model(folder, dtype="float32", tp=TensorParallel(rank=1, size=2)).model
    for name, target in shard.checkpoint_targets().items():
        where = shard.shard_slice(name)
        whole = full[name]
        expected = whole if where is None else whole.narrow(where.dim, where.start, where.length)
        assert torch.equal(target[: expected.shape[0]], expected), name
    assert shard.num_kv_heads == 1 and shard.model.embed_tokens.weight.shape[0] == 160


def test_the_roofline_counts_one_rank_share(tmp_path_factory):
    """Each rank's roofline is its device's: half the matmul FLOPs and weight bytes of the layers."""
    from pagoda.server.engine.loader import load_model
    from pagoda.server.engine.parallel.group import TensorParallel
    from pagoda.server.engine.roofline import ModelCosts

    folder = tiny_model_dir("llama", tmp_path_factory)
    whole = ModelCosts.from_model(load_model(folder, dtype="float32").model, 1024)
    half = ModelCosts.from_model(load_model(folder, dtype="float32", tp=TensorParallel(1, 2)).model, 512)
    assert half.body_flops_per_token * 2 == whole.body_flops_per_token
    assert half.head_flops_per_row * 2 == whole.head_flops_per_row
    assert half.attn_flops_per_context * 2 == whole.attn_flops_per_context
    assert half.embed_row_bytes == whole.embed_row_bytes and half.head_bytes * 2 == whole.head_bytes
    assert whole.body_bytes / 2 < half.body_bytes < whole.body_bytes  # the norms are whole on each rank
