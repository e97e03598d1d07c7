"""What the KV cache manager did, step by step: a bounded ring of block events for the live views
(`/kv`, `/kv/events`, `pagoda top`).

Why a ring: the step loop must never wait for a viewer. `record` appends one small dict under an
uncontended lock and never blocks on a reader; the ring keeps the newest `capacity` events. Readers
keep their own cursor (the id of the next event they want) and learn how many events the
ring overwrote before they read them: a slow client drops events, and the drop is counted.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

DEFAULT_CAPACITY = 4096

# kind -> (what just happened, the term PagedAttention (Kwon et al., SOSP 2023) or vLLM uses for it)
KINDS: dict[str, tuple[str, str]] = {
    "alloc": (
        "the sequence grew into new blocks, taken from the free pool only as its tokens are written",
        "on-demand block allocation; the block table maps logical to physical blocks",
    ),
    "cache": (
        "a block filled up and was hashed: a later prompt with the same tokens can reuse it",
        "prefix caching: block hash chained over the parent block",
    ),
    "prefix_hit": (
        "a new sequence found its leading blocks cached and skips computing them",
        "shared prefix (automatic prefix caching)",
    ),
    "fork": (
        "parallel samples share every block of the prompt; each shared block's ref count went up",
        "sharing via reference counts (parallel sampling, beam search)",
    ),
    "cow": (
        "a sample wrote into a shared, partly filled block: it got its own copy first",
        "copy-on-write at block granularity",
    ),
    "free": (
        "a sequence finished or left: its blocks' ref counts went down; full ones stay cached",
        "freeing blocks (reference count reaches zero)",
    ),
    "evict": (
        "the pool needed a block: the least recently freed cached block lost its content",
        "eviction (LRU over cached free blocks)",
    ),
    "preempt": (
        "out of blocks: the newest request gave all its blocks back and will be recomputed",
        "preemption by recomputation (all-or-nothing eviction)",
    ),
    "reset": ("the prefix cache was emptied: cached blocks became plain free blocks", "cache reset"),
}


class KVEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: the event ring needs at least one slot, got {capacity}")
        self.capacity = capacity
        self._ring: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.next_seq = 0  # the id the next event gets (ids count up from 0)
        self.step = 0  # the engine step the events belong to (1 = the first; set by the engine)
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.dropped = 0  # events readers missed because the ring overwrote them first

    def record(self, kind: str, **fields: Any) -> None:
        """Called by the block manager and scheduler on the step thread: O(1), never waits on a reader."""
        with self._lock:
            self._ring.append(
                {"id": self.next_seq, "step": self.step, "time": time.time(), "kind": kind, **fields}
            )
            self.next_seq += 1
            self.counts[kind] += 1

    def read(self, cursor: int, limit: int | None = None) -> tuple[list[dict[str, Any]], int]:
        """(events with id >= cursor, oldest first, at most `limit`; how many the ring already lost)."""
        with self._lock:
            if not self._ring or cursor >= self.next_seq:
                return [], 0
            oldest = self._ring[0]["id"]
            dropped = max(0, oldest - cursor)
            self.dropped += dropped
            start = max(cursor, oldest) - oldest
            stop = len(self._ring) if limit is None else min(len(self._ring), start + limit)
            return list(itertools.islice(self._ring, start, stop)), dropped

    def recent(self, count: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(itertools.islice(self._ring, max(0, len(self._ring) - count), None))


def describe(kind: str) -> dict[str, str]:
    what, term = KINDS[kind]
    return {"what": what, "term": term}
