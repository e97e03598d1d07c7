"""`/kv/state` and `/kv/events` against a real server (tiny random model): the snapshot's schema, its
numbers against the block manager's own counts and /metrics, the event stream, the API key."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Callable

import jsonschema
import pytest
from pagoda.server.api.kv_snapshot_cache import COST_FACTOR, SharedSnapshot
from pagoda.server.api.state import ServerConfig
from support.pagoda_serve import metric_value

INT = {"type": "integer", "minimum": 0}
NUM = {"type": "number", "minimum": 0}
INTS = {"type": "array", "items": INT}
SEQ = {
    "type": "object",
    "required": ["seq_id", "index", "block_table", "tokens_in_cache", "tokens", "prompt_tokens",
                 "output_tokens", "empty_slots"],
    "properties": {"block_table": INTS, "tokens_in_cache": INT, "empty_slots": INT},
}  # fmt: skip
EVENT = {
    "type": "object",
    "required": ["id", "step", "time", "kind"],
    "properties": {
        "kind": {"enum": ["alloc", "cache", "prefix_hit", "fork", "cow", "free", "evict", "preempt", "reset"]},
        "id": INT, "step": INT,
    },
}  # fmt: skip
STATE_SCHEMA = {
    "type": "object",
    "required": ["time", "step", "model", "block_size", "num_blocks", "blocks", "requests", "counters",
                 "headline", "roofline", "recent_events", "kinds"],
    "properties": {
        "step": INT, "block_size": {"type": "integer", "minimum": 1}, "num_blocks": {"type": "integer", "minimum": 1},
        "blocks": {
            "type": "object",
            "required": ["state", "ref_count", "owner", "filled"],
            "properties": {
                "state": {"type": "array", "items": {"enum": ["free", "cached", "used"]}},
                "ref_count": INTS,
                "owner": {"type": "array", "items": {"type": ["string", "null"]}},
                "filled": INTS,
            },
        },
        "requests": {"type": "array", "items": {
            "type": "object",
            "required": ["id", "status", "prompt_tokens", "prefix_hit_tokens", "seqs"],
            "properties": {"status": {"enum": ["running", "waiting"]}, "seqs": {"type": "array", "items": SEQ}},
        }},
        "counters": {"type": "object", "required": ["alloc_events", "cow_events", "fork_events", "free_events",
                     "prefix_hit_events", "evict_events", "preempt_events", "events_recorded",
                     "events_dropped", "preemptions", "prefix_cache_hits"],
                     "additionalProperties": INT},
        "headline": {"type": "object", "required": ["blocks_used", "blocks_cached", "blocks_free",
                     "blocks_shared", "usage", "usage_target", "capacity_tokens", "mean_seq_tokens",
                     "capacity_seqs_at_mean_len", "waste_slots", "waste_pct"],
                     "properties": {"usage": {"type": "number", "minimum": 0, "maximum": 1},
                                    "waste_pct": {"type": "number", "minimum": 0, "maximum": 100},
                                    "mean_seq_tokens": {"type": ["number", "null"]},
                                    "capacity_seqs_at_mean_len": {"type": ["integer", "null"]}}},
        "roofline": {"type": "object", "required": ["peak_bytes_per_s", "peak_flops_per_s", "ridge_intensity",
                     "peak_source", "bound_steps", "last_step"],
                     "properties": {"peak_bytes_per_s": {"type": "number", "exclusiveMinimum": 0},
                                    "peak_flops_per_s": {"type": "number", "exclusiveMinimum": 0}}},
        "recent_events": {"type": "array", "items": EVENT},
        "kinds": {"type": "object", "required": ["alloc", "cow", "fork", "free", "prefix_hit", "evict", "preempt"],
                  "additionalProperties": {"type": "object", "required": ["what", "term"],
                                           "properties": {"what": {"type": "string", "minLength": 10}}}},
    },
}  # fmt: skip


def get_json(url: str, path: str, headers: dict | None = None):
    request = urllib.request.Request(url + path, headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def fresh_state(url: str, ready: Callable[[dict], bool], timeout: float = 30) -> dict:
    """/kv/state once it shows `ready`: the shared snapshot may be up to COST_FACTOR x its build
    cost old (on a loaded machine, longer than a short request takes)."""
    deadline = time.monotonic() + timeout
    while not ready(state := get_json(url, "/kv/state")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return state


def complete(url: str, model: str, prompt: str, **params) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, **params}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def check_consistent(state: dict) -> None:
    """The snapshot agrees with itself: states, ref counts, tables and headline counts."""
    blocks = state["blocks"]
    used = [i for i, s in enumerate(blocks["state"]) if s == "used"]
    assert len(used) == state["headline"]["blocks_used"]
    assert all(blocks["ref_count"][i] > 0 for i in used)
    assert all(blocks["ref_count"][i] == 0 for i, s in enumerate(blocks["state"]) if s != "used")
    refs = {}
    for request in state["requests"]:
        for seq in request["seqs"]:
            for block in seq["block_table"]:
                refs[block] = refs.get(block, 0) + 1
                assert blocks["owner"][block] is not None
    assert refs == {i: blocks["ref_count"][i] for i in used}
    shared = sum(1 for i in used if blocks["ref_count"][i] > 1)
    assert shared == state["headline"]["blocks_shared"]


def test_idle_state_matches_schema_and_metrics(server):
    state = get_json(server.url, "/kv/state")
    jsonschema.validate(state, STATE_SCHEMA)
    assert state["num_blocks"] == 64 and state["block_size"] == 16
    assert len(state["blocks"]["state"]) == 64
    assert state["headline"]["blocks_used"] == metric_value(server.url, "pagoda_kv_cache_blocks_used") == 0
    assert state["headline"]["capacity_tokens"] == metric_value(server.url, "pagoda_kv_cache_capacity_tokens")
    check_consistent(state)


def test_state_while_running_is_consistent(server):
    """Snapshots taken while n=2 requests decode: every one agrees with itself (taken between steps),
    shared prompt blocks have ref count 2, and afterwards nothing is held."""
    model = server.state.model_name
    prompt = "one two three four five six seven eight nine ten " * 4
    done = threading.Event()

    def run():
        try:
            complete(server.url, model, prompt, max_tokens=48, n=2, temperature=1.0, ignore_eos=True, seed=3)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    seen_shared = False
    snapshots = 0
    while not done.is_set():
        state = get_json(server.url, "/kv/state")
        jsonschema.validate(state, STATE_SCHEMA)
        check_consistent(state)
        snapshots += 1
        seen_shared |= 2 in state["blocks"]["ref_count"]
    assert snapshots >= 3
    assert seen_shared, "n=2 never showed a block with ref count 2"
    state = fresh_state(server.url, lambda state: not state["requests"])
    assert state["headline"]["blocks_used"] == 0 and not state["requests"]
    kinds = {e["kind"] for e in state["recent_events"]}
    assert {"alloc", "fork", "cow", "free"} <= kinds, kinds
    assert state["roofline"]["last_step"]["bytes"] > 0


def read_events(url: str, since: int, until: Callable[[list[dict]], bool], timeout: float = 30) -> list[dict]:
    """The stream's events from `since` on, read until `until(events)` holds."""
    events = []
    with urllib.request.urlopen(f"{url}/kv/events?since={since}", timeout=timeout) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        kind = None
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: ") and kind == "kv":
                events.append(json.loads(line.removeprefix("data: ")))
                if until(events):
                    return events
    return events


def test_event_stream_replays_and_follows(server):
    model = server.state.model_name
    start = get_json(server.url, "/kv/state")["counters"]["events_recorded"]
    prompt = "a shared prompt that is longer than one block of sixteen tokens, surely " * 2
    complete(server.url, model, prompt, max_tokens=4)
    complete(server.url, model, prompt, max_tokens=4)  # the same prompt again: a prefix hit
    # the stream replays from `start` (the state's count may be older than the requests: cached)
    events = read_events(server.url, start, lambda events: events[-1]["kind"] == "prefix_hit")
    assert [e["id"] for e in events] == list(range(start, start + len(events)))
    first_alloc = next(e for e in events if e["kind"] == "alloc")
    assert first_alloc["req"] and first_alloc["blocks"]
    assert events[-1]["tokens"] >= 16
    state = fresh_state(server.url, lambda state: state["counters"]["events_recorded"] > events[-1]["id"])
    hits = [e for e in state["recent_events"] if e["kind"] == "prefix_hit" and e["id"] >= start]
    assert hits and hits[0]["tokens"] >= 16
    assert state["counters"]["prefix_cache_hits"] >= 16


def test_a_client_that_does_not_read_drops_events_and_is_told(server):
    """A stream opened and left unread while the ring wraps: when it reads, it gets a `dropped`
    frame with the count, then the newest events."""
    log = server.state.engine.kv_events
    since = log.next_seq
    for _ in range(log.capacity + 10):  # wrap the ring (the log is thread-safe: record from here)
        log.record("evict", block=0)
    with urllib.request.urlopen(f"{server.url}/kv/events?since={since}", timeout=30) as response:
        head = [response.readline().decode() for _ in range(2)]
    assert head[0] == "event: dropped\n"
    dropped = json.loads(head[1].removeprefix("data: "))
    assert dropped["dropped"] == log.next_seq - log.capacity - since == 10
    counters = fresh_state(server.url, lambda state: state["counters"]["events_dropped"] >= 10)["counters"]
    assert counters["events_dropped"] >= 10


def test_bad_since_is_a_400(server, http_request):
    result = http_request(server.url, "GET", "/kv/events?since=soon")
    assert result.status == 400 and result.json()["error"]["param"] == "since"


@pytest.fixture(scope="module")
def keyed_server(start_server):
    return start_server(ServerConfig(api_key="sesame"))


def test_kv_views_need_the_api_key(keyed_server, http_request):
    url = keyed_server.url
    for path in ("/kv", "/kv/state", "/kv/kv.js", "/kv/events"):
        result = http_request(url, "GET", path)
        assert result.status == 401, path
        assert result.json()["error"]["code"] == "invalid_api_key"
    assert get_json(url, "/kv/state", {"Authorization": "Bearer sesame"})["num_blocks"] == 64
    # a browser: the key in the page's URL once, then the cookie for its own requests
    with urllib.request.urlopen(f"{url}/kv?api_key=sesame", timeout=30) as response:
        cookie = response.headers["Set-Cookie"]
        assert "pagoda_api_key=sesame" in cookie and "HttpOnly" in cookie
        assert b"<title>pagoda" in response.read()
    assert get_json(url, "/kv/state", {"Cookie": "pagoda_api_key=sesame"})["num_blocks"] == 64
    assert http_request(url, "GET", "/kv/state", headers={"Cookie": "pagoda_api_key=wrong"}).status == 401


def test_metrics_export_the_step_roofline(server):
    model = server.state.model_name
    complete(server.url, model, "roofline " * 20, max_tokens=8)
    assert metric_value(server.url, "pagoda_step_bytes_total") > 0
    assert metric_value(server.url, "pagoda_step_flops_total") > 0
    assert metric_value(server.url, "pagoda_step_forward_seconds_total") > 0
    assert metric_value(server.url, "pagoda_step_peak_bytes_per_second") > 0
    assert metric_value(server.url, "pagoda_step_bandwidth_utilization_count") >= 8


def test_metrics_export_the_engine_loops_busy_time_and_its_hand_off(server):
    """The loop's busy time holds every forward (and the rest of each step), the hand-off is part of it."""
    complete(server.url, server.state.model_name, "busy " * 20, max_tokens=8)
    forward = metric_value(server.url, "pagoda_step_forward_seconds_total")
    busy = metric_value(server.url, "pagoda_engine_busy_seconds_total")
    handoff = metric_value(server.url, "pagoda_engine_handoff_seconds_total")
    assert busy >= forward > 0
    assert 0 < handoff < busy


async def test_viewers_share_one_snapshot_rebuilt_as_often_as_it_is_cheap():
    builds = 0

    async def build():
        nonlocal builds
        builds += 1
        await asyncio.sleep(0.01)
        return {"n": builds}, 0.005  # 5 ms on the step thread: rebuilt at most every 100 ms

    shared = SharedSnapshot(build)
    bodies = await asyncio.gather(*[shared.get() for _ in range(10)])
    assert builds == 1 and set(bodies) == {b'{"n": 1}'}
    assert shared.min_interval >= COST_FACTOR * 0.005
    assert await shared.get() == b'{"n": 1}'
    await asyncio.sleep(shared.min_interval + 0.01)
    assert await shared.get() == b'{"n": 2}'
