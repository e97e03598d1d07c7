"""The /kv page in a real headless Chromium against a real `pagoda serve` (tiny random model).

The page is driven only as a user's browser would load it (its own polling and EventSource); the
test reads what the page shows (DOM text and the grid cells' data attributes) and asks the page to
refresh now (`kv.refresh()`, the function its own timer calls) to compare with /metrics at one moment.

PAGODA_KV_PNG=docs/img/kv-page.png also saves the screenshot there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.chromium import Chromium, chromium_binary
from support.pagoda_serve import metric_value, pagoda_serve
from support.tiny_models import tiny_model_dir

MODEL = "tiny"


def flags(block_size: int) -> list[str]:
    return ["--served-model-name", MODEL, "--enable-prefix-caching", "--num-blocks", "96", "--block-size",
            str(block_size), "--max-num-seqs", "8", "--max-model-len", "512"]  # fmt: skip


PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 3  # > 2 blocks of 16


def complete(url: str, prompt: str, **params) -> dict:
    body = json.dumps({"model": MODEL, "prompt": prompt, **params}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def in_background(*calls) -> threading.Event:
    """Run each (url, prompt, params) request in its own thread; the event is set when all are done."""
    done = threading.Event()
    threads = [
        threading.Thread(target=complete, args=args[:2], kwargs=args[2], daemon=True) for args in calls
    ]

    def wait():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    return done


USED_SHOWN = "Number(document.getElementById('used').textContent)"
# After a request ends, the page may still get a snapshot from before its last step (viewers share one
# for COST_FACTOR x its cost: kv_snapshot_cache.py, longer on a loaded host): poll until it shows none.
NONE_USED = f"kv.refresh().then(() => {USED_SHOWN} === 0)"


@contextlib.contextmanager
def served_with_page(block_size: int, tmp_path_factory) -> Iterator[tuple[str, Chromium]]:
    """`pagoda serve` on the tiny model and its /kv page open in Chromium: (the server's URL, the page)."""
    if chromium_binary() is None:
        pytest.fail("`chromium` not found: run scripts/setup.sh --dev (installs Debian's chromium)")
    model = tiny_model_dir("llama", tmp_path_factory)
    with pagoda_serve(model, flags(block_size), tmp_path_factory.mktemp("serve") / "serve.log") as url:
        browser = Chromium(url + "/kv", tmp_path_factory.mktemp("chromium"))
        try:
            browser.wait_for("window.kv && kv.frames.length > 0 && kv.source !== null")
            yield url, browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_with_page(16, tmp_path_factory) as both:
        yield both


@pytest.fixture(scope="module")
def pod(served):
    return served[0]


@pytest.fixture(scope="module")
def page(served):
    return served[1]


def test_used_blocks_on_the_page_equal_the_metric_while_requests_run(tmp_path_factory):
    # A server of its own with blocks of 64 tokens: one sequence then takes a block every ~0.1 s, and a
    # read (two scrapes around the page's refresh) takes ~30 ms. With blocks of 16 a block came about
    # once a read, and on a busy host the reads rarely found no change around them.
    with served_with_page(64, tmp_path_factory) as (pod, page):
        agree_while_requests_run(pod, page)


def agree_while_requests_run(pod: str, page: Chromium) -> None:
    agreed = []
    # Waves of one long request until three reads agree while blocks are in use: the tiny model decodes
    # fast enough that a wave can end within a few reads, and one sequence takes blocks the least often
    # (with three, one of them did every few steps).
    for wave in range(8):
        done = in_background((pod, f"{wave} {PROMPT}", {"max_tokens": 300, "ignore_eos": True}))
        while not done.is_set():
            started = time.time()
            before = metric_value(pod, "pagoda_kv_cache_blocks_used")
            taken, shown = page.evaluate(f"kv.refresh().then(s => [s.time, {USED_SHOWN}])")
            after = metric_value(pod, "pagoda_kv_cache_blocks_used")
            # no block changed hands around the page's read, and the page's snapshot is from this window
            # (viewers share a snapshot for a few ms: kv_snapshot_cache.py)
            if before == after and taken > started and not done.is_set():
                assert shown == before, (shown, before)
                agreed.append(shown)
        done.wait()
        if len([n for n in agreed if n > 0]) >= 3:
            break
    assert len([n for n in agreed if n > 0]) >= 3, agreed
    assert page.wait_for(NONE_USED, timeout=10) and metric_value(pod, "pagoda_kv_cache_blocks_used") == 0


def test_parallel_samples_share_blocks_then_copy_on_write(pod, page, tmp_path):
    done = in_background(
        (pod, PROMPT, {"max_tokens": 160, "n": 2, "temperature": 1.0, "seed": 7, "ignore_eos": True})
    )
    shared = page.wait_for(
        "kv.refresh().then(() => document.querySelectorAll('#grid .block.used[data-ref=\"2\"]').length)"
    )
    assert shared >= 3  # the prompt's full blocks, shared by both samples
    assert (
        page.evaluate("document.querySelectorAll('#grid .block.used[data-ref=\"2\"] .ref')[0].textContent")
        == "2"
    )
    screenshot(page, tmp_path)
    page.wait_for("document.querySelector('#log li[data-kind=\"cow\"]') !== null")
    cow = page.evaluate("document.querySelector('#log li[data-kind=\"cow\"]').textContent")
    assert "copy-on-write" in cow and "own copy" in cow
    assert page.evaluate("document.querySelector('#log li[data-kind=\"fork\"]') !== null")
    assert done.wait(300)
    assert page.wait_for(NONE_USED, timeout=10)


def screenshot(page: Chromium, tmp_path: Path) -> None:
    """While the samples share blocks: the page as a user sees it (docs/img/kv-page.png)."""
    page.evaluate("kv.refresh()")
    path = tmp_path / "kv-page.png"
    page.screenshot(path)
    assert path.stat().st_size > 20_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("PAGODA_KV_PNG"):
        shutil.copyfile(path, os.environ["PAGODA_KV_PNG"])


def test_a_shared_prompt_shows_prefix_cache_hits(pod, page):
    prompt = "Shared system prompt: answer briefly and politely, in English. " * 3
    complete(pod, prompt + "First question?", max_tokens=4)
    complete(pod, prompt + "Second question?", max_tokens=4)
    page.wait_for("document.querySelector('#log li[data-kind=\"prefix_hit\"]') !== null")
    text = page.evaluate("document.querySelector('#log li[data-kind=\"prefix_hit\"]').textContent")
    assert "tokens from cached blocks" in text and "shared prefix" in text
    page.evaluate("kv.refresh()")
    assert int(page.evaluate("document.getElementById('cached').textContent")) >= 2


def test_pause_and_step_through_history(pod, page):
    page.evaluate("kv.refresh()")
    # Pausing holds the newest snapshot; the page keeps polling, so more may arrive after it (read
    # the view and the label in one evaluation, as one moment of the page).
    frames, view, label = page.evaluate(
        "(document.getElementById('pause').click(),"
        " [kv.frames.length, kv.view, document.getElementById('frame').textContent])"
    )
    assert view == frames - 1 and label.startswith(f"snapshot {frames} of {frames}")
    page.evaluate("document.getElementById('back').click()")
    assert page.evaluate("document.getElementById('frame').textContent").startswith(
        f"snapshot {frames - 1} of"
    )
    time.sleep(1.2)  # the page keeps polling while paused: the view stays on the chosen snapshot
    assert page.evaluate("kv.view") == frames - 2
    page.evaluate("document.getElementById('forward').click()")
    page.evaluate("document.getElementById('pause').click()")
    assert page.evaluate("document.getElementById('frame').textContent") == "live"


def test_page_shows_the_roofline(pod, page):
    complete(pod, PROMPT, max_tokens=8)
    page.evaluate("kv.refresh()")
    assert page.evaluate("document.getElementById('bound').textContent") in ("memory-bound", "compute-bound")
    text = page.evaluate("document.getElementById('roofline').textContent")
    assert "of peak bandwidth" in text and "of peak compute" in text
