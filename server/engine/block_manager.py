"""KV cache manager: a pool of fixed-size physical blocks, per-sequence block tables, ref counts.

- Blocks are allocated on demand, as a sequence's tokens are about to be written.
- Forking (n > 1 sampling, beam search) shares blocks by ref count; a write into a shared,
  partially filled block copies it first (copy-on-write): the writer gets a fresh block and the
  engine copies the cache contents (src → dst) for every layer before the step runs.
- Prefix caching: a FULL block is identified by a hash chained over its parent block's hash and its
  own token ids. Freed blocks that carry a hash stay in the cache (LRU order) and are only evicted
  when the pool needs a block; a new sequence reuses every leading cached block of its tokens.

Every "how many blocks" question is answered here (`blocks_for_tokens` is the one rounding rule).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from pagoda.server.engine.kv_events import KVEventLog

if TYPE_CHECKING:
    from pagoda.server.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once the block is full and registered in the cache
        self.token_ids: tuple[int, ...] = ()  # of a registered block, to rule out hash collisions


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))  # uncached free blocks
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, LRU first
        self._hash_to_block: dict[int, int] = {}
        self.num_shared_blocks = 0  # blocks with ref_count > 1, kept incrementally for cheap stats
        self.num_evictions = 0
        self.events = events if events is not None else KVEventLog()  # what happened, for the live views

    # ---- pool accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    def _take_block(self) -> int:
        if self._free_ids:
            block_id = self._free_ids.popleft()
        elif self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)  # evict the least recently freed
            block = self.blocks[block_id]
            del self._hash_to_block[block.block_hash]
            block.block_hash, block.token_ids = None, ()
            self.num_evictions += 1
            self.events.record("evict", block=block_id)
        else:
            raise NoFreeBlocksError("KV cache pool exhausted")
        self.blocks[block_id].ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._cached_free.pop(block_id)  # a cached block comes back to life
        elif block.ref_count == 1:
            self.num_shared_blocks += 1
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 1:
            self.num_shared_blocks -= 1
        elif block.ref_count == 0:
            if block.block_hash is not None:
                self._cached_free[block_id] = None
            else:
                self._free_ids.append(block_id)

    # ---- prefix cache ----------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """The chained hashes of the sequence's first `num_full_blocks` blocks (memoised on it)."""
        hashes, tokens, size = seq.block_hashes, seq.token_ids, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(
                chain_hash(hashes[-1] if hashes else None, tuple(tokens[i * size : (i + 1) * size]))
            )
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the sequence's leading full blocks (the last token is always
        recomputed, so the model has a position to produce logits from)."""
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        hits: list[int] = []
        for i, block_hash in enumerate(self._block_hashes(seq, (len(seq.token_ids) - 1) // size)):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                seq.token_ids[i * size : (i + 1) * size]
            ):
                break
            hits.append(block_id)
        return hits

    def num_reviving(self, block_ids: list[int]) -> int:
        """How many of these cached blocks are currently free (taking them shrinks the free pool)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def adopt_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Start an empty sequence on cached blocks: they count as already computed."""
        assert not seq.block_table
        for block_id in block_ids:
            self._ref(block_id)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(block_ids) * self.block_size
        seq.num_registered_blocks = len(block_ids)
        self.events.record(
            "prefix_hit", req=seq.request_id, seq_id=seq.seq_id, blocks=list(block_ids),
            tokens=seq.num_computed_tokens,
        )  # fmt: skip

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: make the sequence's newly completed full blocks findable by their hash."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        size = self.block_size
        registered = []
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            # Skip blocks already registered (shared via fork) and content already cached elsewhere.
            if block.block_hash is None and hashes[i] not in self._hash_to_block:
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * size : (i + 1) * size])
                self._hash_to_block[hashes[i]] = block.block_id
                registered.append(block.block_id)
        seq.num_registered_blocks = num_full
        if registered:
            self.events.record("cache", req=seq.request_id, seq_id=seq.seq_id, blocks=registered)

    # ---- per-sequence allocation -------------------------------------------------------------
    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """Is the next write into a shared block that already holds some tokens?"""
        offset = seq.num_computed_tokens % self.block_size
        index = seq.num_computed_tokens // self.block_size
        return (
            offset != 0 and index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1
        )

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def blocks_for_request(self, prompt_len: int, max_total: int, num_seqs: int) -> int:
        """The most blocks a request can ever hold: the prompt's blocks once, then each of its
        `num_seqs` sequences' own tail plus a copied partial block (one sequence: just its length)."""
        if num_seqs == 1:
            return self.blocks_for(max_total)
        return self.blocks_for(prompt_len) + num_seqs * (self.blocks_for(max_total - prompt_len) + 1)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks needed to write the sequence's next `num_new_tokens` tokens."""
        end = seq.num_computed_tokens + num_new_tokens
        grow = max(0, self.blocks_for(end) - len(seq.block_table))
        return grow + int(self._needs_copy_on_write(seq))

    def blocks_to_admit(self, seq: Sequence, hits: list[int], end: int) -> int:
        """Free blocks that admitting a sequence takes: its cached prefix `hits` (those now free come
        out of the free pool) and fresh blocks up to token `end`."""
        return self.blocks_for(end) - max(len(hits), len(seq.block_table)) + self.num_reviving(hits)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give the sequence slots for its next `num_new_tokens` tokens; returns copy-on-write
        (src, dst) block pairs whose cache contents the engine must copy before the step."""
        if self.blocks_needed(seq, num_new_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError("KV cache pool exhausted")
        copies = []
        if self._needs_copy_on_write(seq):
            index = seq.num_computed_tokens // self.block_size
            src = seq.block_table[index]
            dst = self._take_block()
            self._release(src)
            seq.block_table[index] = dst
            copies.append((src, dst))
            self.events.record("cow", req=seq.request_id, seq_id=seq.seq_id, index=index, src=src, dst=dst)
        end = seq.num_computed_tokens + num_new_tokens
        first_new = len(seq.block_table)
        while len(seq.block_table) * self.block_size < end:
            seq.block_table.append(self._take_block())
        if len(seq.block_table) > first_new:
            self.events.record(
                "alloc", req=seq.request_id, seq_id=seq.seq_id, index=first_new,
                blocks=seq.block_table[first_new:],
            )  # fmt: skip
        return copies

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A new sequence (output `index`) with the parent's tokens, sharing all of its blocks."""
        child = parent.copy(index)
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        self.events.record(
            "fork", req=parent.request_id, seq_id=parent.seq_id, child_seq_id=child.seq_id,
            blocks=list(parent.block_table),
        )  # fmt: skip
        return child

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Tail blocks first, so LRU eviction takes them first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        if seq.block_table:
            self.events.record(
                "free", req=seq.request_id, seq_id=seq.seq_id, blocks=list(seq.block_table),
                cached=[b for b in seq.block_table if self.blocks[b].block_hash is not None],
            )  # fmt: skip
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-free block (used by benchmarks to measure cold runs)."""
        if self._cached_free:
            self.events.record("reset", blocks=list(self._cached_free))
        for block_id in list(self._cached_free):
            block = self.blocks[block_id]
            del self._hash_to_block[block.block_hash]
            block.block_hash, block.token_ids = None, ()
            self._free_ids.append(block_id)
        self._cached_free.clear()
