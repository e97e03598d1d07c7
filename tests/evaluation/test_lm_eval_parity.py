"""lm-eval itself scores a local multiple-choice task against `pagoda serve` (`local-completions`, so
echo + prompt logprobs over HTTP) and with its own `hf` backend (transformers) on the same fp32
weights: the same accuracy, and every choice's loglikelihood within 1e-3.

lm-eval lives in `.venv-lmeval` (scripts/setup.sh --dev): its dependency tree stays out of the
serving environment. No hub access: the task is `task/pagoda_mc.yaml` over `task/mc.jsonl`, the model
a tiny random Llama with a locally trained tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.prometheus import free_port

ROOT = Path(__file__).resolve().parents[2]
LM_EVAL = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
TASK_DIR = Path(__file__).parent / "task"
TASK = "pagoda_mc"
pytestmark = pytest.mark.skipif(not LM_EVAL.exists(), reason="lm-eval is not set up (scripts/setup.sh --dev)")


def run_lm_eval(model: str, model_args: str, output: Path, tmp_path: Path) -> tuple[float, list[list[float]]]:
    """(accuracy, per-document list of per-choice loglikelihoods) from lm-eval's own output files."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONSAFEPATH": "1"}  # fmt: skip
    command = [str(LM_EVAL), "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
               "--include_path", str(TASK_DIR), "--batch_size", "4", "--output_path", str(output),
               "--log_samples", "--seed", "0", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(command, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (results_file,) = output.rglob("results_*.json")
    accuracy = json.loads(results_file.read_text())["results"][TASK]["acc,none"]
    (samples_file,) = output.rglob(f"samples_{TASK}_*.jsonl")
    docs = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda d: d["doc_id"])
    return accuracy, [[float(resp[0][0]) for resp in doc["resps"]] for doc in docs]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "pagoda serve exited"
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("pagoda serve never became ready")


def test_lm_eval_scores_the_same_through_pagoda_and_transformers(tiny_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    # fp32 explicitly: the comparison is against transformers in fp32.
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(tiny_dir), "--dtype", "float32",
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--num-blocks", "256"],
        env={**os.environ, "PYTHONSAFEPATH": "1"}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_ready(url, process)
        # lm-eval's API models leave BOS out unless told; its hf backend lets the tokenizer add it.
        # add_bos_token=True makes both score the same token sequences.
        served_args = (f"model=tiny,base_url={url}/v1/completions,tokenizer={tiny_dir},add_bos_token=True,"
                       "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1")  # fmt: skip
        served_acc, served = run_lm_eval("local-completions", served_args, tmp_path / "served", tmp_path)
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            metrics = response.read().decode()
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    hf_acc, local = run_lm_eval("hf", f"pretrained={tiny_dir},dtype=float32", tmp_path / "hf", tmp_path)

    assert len(served) == len(local) == 12 and [len(d) for d in served] == [len(d) for d in local]
    worst = max(abs(a - b) for doc_a, doc_b in zip(served, local, strict=True) for a, b in zip(doc_a, doc_b, strict=True))
    print(f"\naccuracy: pagoda {served_acc:.4f}, hf {hf_acc:.4f}; max |Δ loglikelihood| {worst:.2e}")
    for i, (doc_a, doc_b) in enumerate(zip(served, local, strict=True)):
        print(f"doc {i:2d}: pagoda {[round(x, 4) for x in doc_a]}  hf {[round(x, 4) for x in doc_b]}")
    assert worst < 1e-3
    assert served_acc == hf_acc
    assert all(x < 0 for doc in served for x in doc)  # real scores, not placeholders
    # the server scored every choice: one prompt each, none of them generated beyond its one token
    requests = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith('pagoda_requests_finished_total{finished_reason="length"'))  # fmt: skip
    assert requests == sum(len(doc) for doc in served)
