"""The KV event ring and what the block manager records in it: every event of a scripted life
(allocate, hash, fork, copy-on-write, free, prefix hit, eviction), and drops counted, not waited for."""

from __future__ import annotations

import threading
import time

import pytest
from pagoda.server.engine.block_manager import BlockManager
from pagoda.server.engine.kv_events import KINDS, KVEventLog, describe
from pagoda.server.engine.sequence import Sequence


def seq_of(tokens, request_id: str) -> Sequence:
    seq = Sequence(0, list(tokens), len(tokens), detokenizer=None)
    seq.request_id = request_id
    return seq


def kinds(log: KVEventLog, since: int = 0) -> list[str]:
    return [e["kind"] for e in log.read(since)[0]]


def test_ring_keeps_the_newest_and_counts_what_a_reader_missed():
    log = KVEventLog(capacity=4)
    for block in range(10):
        log.record("evict", block=block)
    events, dropped = log.read(0)
    assert dropped == 6 and [e["block"] for e in events] == [6, 7, 8, 9]
    assert [e["id"] for e in events] == [6, 7, 8, 9]
    assert log.read(10) == ([], 0)  # caught up
    assert [e["id"] for e in log.read(8, limit=1)[0]] == [8]
    assert log.dropped == 6 and log.counts["evict"] == 10
    assert [e["block"] for e in log.recent(2)] == [8, 9]
    with pytest.raises(ValueError, match="capacity"):
        KVEventLog(capacity=0)


def test_every_kind_explains_itself_with_the_papers_term():
    for kind in KINDS:
        text = describe(kind)
        assert len(text["what"]) > 20 and text["term"]


def test_a_life_in_blocks():
    log = KVEventLog()
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=True, events=log)
    a = seq_of(range(6), "a")
    bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    bm.register_full_blocks(a)
    child = bm.fork(a, index=1)
    assert (child.token_ids, child.request_id) == (a.token_ids, "a") and child.token_ids is not a.token_ids
    bm.allocate_slots(child, 1)  # into the shared partial block: copy-on-write
    bm.free(child)
    bm.free(a)
    b = seq_of([*range(4), 99, 98], "b")  # same first block: a prefix hit
    bm.adopt_prefix(b, bm.match_prefix(b))
    bm.allocate_slots(b, 2)
    bm.free(b)
    c = seq_of(range(100, 120), "c")  # the whole pool: the 4 free blocks, then the cached one
    bm.allocate_slots(c, 20)
    expected = "alloc cache fork cow free free prefix_hit alloc free evict alloc"
    assert kinds(log) == expected.split()
    events = log.read(0)[0]
    alloc, cache, fork, cow, free_child, free_a, hit = events[:7]
    assert free_child["seq_id"] == child.seq_id and free_child["cached"] == [0]  # block 0 still shared
    assert alloc["req"] == "a" and alloc["blocks"] == [0, 1] and alloc["index"] == 0
    assert cache["blocks"] == [0]
    assert fork["seq_id"] == a.seq_id and fork["child_seq_id"] == child.seq_id and fork["blocks"] == [0, 1]
    assert (cow["src"], cow["index"]) == (1, 1) and cow["dst"] not in (0, 1)
    assert free_a["cached"] == [0]  # the full, hashed block keeps its content
    assert hit["req"] == "b" and hit["blocks"] == [0] and hit["tokens"] == 4
    assert events[9]["block"] == 0 and 0 in events[10]["blocks"]  # the cached block, reused


def test_recording_never_waits_for_a_reader():
    """A reader holding the newest events (as a slow stream does) costs the writer nothing: record
    is O(1) whatever the readers do, about a microsecond."""
    log = KVEventLog(capacity=1024)
    stop = threading.Event()

    def reader():
        cursor = 0
        while not stop.is_set():
            events, _ = log.read(cursor, limit=64)
            cursor = events[-1]["id"] + 1 if events else cursor
            time.sleep(0.001)  # slower than the writer

    thread = threading.Thread(target=reader)
    thread.start()
    started = time.perf_counter()
    for block in range(20_000):
        log.record("alloc", req="r", seq_id=1, index=block, blocks=[block])
    per_event = (time.perf_counter() - started) / 20_000
    stop.set()
    thread.join()
    assert per_event < 50e-6, per_event
    assert log.next_seq == 20_000
