"""`pagoda bench serve` against the real server, and its random workload."""

from __future__ import annotations

import json

from pagoda.server.bench.dataset import load_tokenizer, random_requests

from pagoda.cli import main as pagoda


def test_random_workload_lengths_and_shared_prefix(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir))
    requests = random_requests(50, 20, 10, range_ratio=0.5, shared_prefix_len=8, seed=1, tokenizer=tokenizer)
    assert all(18 <= r.prompt_len <= 38 and len(r.prompt) == r.prompt_len for r in requests)
    assert all(5 <= r.output_len <= 15 for r in requests)
    assert (
        len({tuple(r.prompt[:8]) for r in requests}) == 1 and len({tuple(r.prompt) for r in requests}) == 50
    )
    assert (
        random_requests(5, 20, 10, seed=1, tokenizer=tokenizer)[0].prompt
        == random_requests(5, 20, 10, seed=1, tokenizer=tokenizer)[0].prompt
    )
    words = random_requests(3, 12, 4, shared_prefix_len=4)
    assert all(
        len(r.prompt.split()) == 16 and r.prompt.split()[:4] == words[0].prompt.split()[:4] for r in words
    )


def test_bench_serve_against_the_server(server, tiny_dir, tmp_path, capsys):
    result, png = tmp_path / "result.json", tmp_path / "latency.png"
    code = pagoda(
        ["bench", "serve", "--base-url", server.url, "--num-prompts", "12", "--max-concurrency", "4",
         "--request-rate", "50", "--input-len", "16", "--output-len", "8", "--range-ratio", "0.5",
         "--shared-prefix-len", "16", "--tokenizer", str(tiny_dir), "--save-result", str(result),
         "--plot", str(png), "--no-progress"]
    )  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "Successful requests" in table and "Median TTFT (ms)" in table and "P99 ITL (ms)" in table
    saved = json.loads(result.read_text())
    summary = saved["runs"][0]["summary"]
    assert summary["successful_requests"] == 12 and summary["failed_requests"] == 0
    expected_tokens = sum(
        r.output_len for r in random_requests(12, 16, 8, 0.5, 16, 0, load_tokenizer(str(tiny_dir)))
    )
    assert summary["total_output_tokens"] == expected_tokens  # ignore_eos: exact output lengths
    assert summary["output_throughput"] > 0 and summary["median_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sweep_over_chat_with_offline_ratio(server, tiny_dir, capsys):
    code = pagoda(
        ["bench", "serve", "--base-url", server.url + "/v1", "--endpoint", "chat", "--num-prompts", "2,6",
         "--max-concurrency", "1,3", "--repeats", "2", "--input-len", "12", "--output-len", "6", "--no-progress", "--offline",
         "--offline-model", str(tiny_dir), "--offline-kv-cache-memory", "8MiB"]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("HTTP / offline throughput ratio") == 2
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["2", "6"]  # successful requests per point
    assert all(float(row.split("|")[10]) > 0 for row in rows)  # the HTTP/offline ratio column
