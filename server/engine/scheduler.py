"""Iteration-level scheduler: continuous batching, chunked prefill, preemption by recompute.

Every sequence is uniformly "tokens in the cache" + "tokens still to run" (a prompt, a prompt chunk,
a recomputation after preemption, or the one token sampled last step). Each step:
1. running requests, oldest first, get their next tokens (1 for a decode, a chunk for a prefill)
   within the token budget; when the pool has no block for one, the newest running request is
   preempted (blocks freed, re-queued at the front of the waiting queue, recomputed later);
2. if nothing was preempted, waiting requests are admitted in arrival order (first-come first-served)
   while seats, token budget and blocks last, reusing cached prefix blocks.
The step's sequences are packed prefills first, then decodes (one token each).

Blocks go back to the pool in one place, `release`: when a request finishes or is aborted, when it is
preempted, and (called by the engine after each step) when single sequences finish or beams are pruned.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagoda.server.engine.block_manager import BlockManager
from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.prompt_logprobs import PromptScores, cacheable_prompt_tokens
from pagoda.server.engine.sequence import Request, Sequence

DEFAULT_CHUNKED_BATCH_TOKENS = 2048  # the step budget with chunked prefill (vLLM's default too)


def step_token_budget(args: EngineArgs, max_model_len: int) -> int:
    """Tokens one step may run: as asked, else a default that, without chunked prefill, also covers
    the longest sequence (a preempted one is recomputed in one step: it must always fit)."""
    if args.max_num_batched_tokens is not None:
        budget = args.max_num_batched_tokens
    elif args.enable_chunked_prefill:
        budget = DEFAULT_CHUNKED_BATCH_TOKENS
    else:
        budget = max(DEFAULT_CHUNKED_BATCH_TOKENS, max_model_len)
    if not args.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens: {budget} is below max_model_len {max_model_len}; "
            "without chunked prefill a sequence must fit in one step (enable chunked prefill, "
            "raise the limit or lower max_model_len)"
        )
    return budget

@dataclass
class ScheduledSeq:
    seq: Sequence
    request: Request
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """After this step all the sequence's tokens are in the cache: it samples a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    num_preempted: int = 0
    # Requests dropped because the whole pool cannot hold them (their blocks are already freed).
    unservable: list[Request] = field(default_factory=list)
    # Filled by the runner: prompt-token logprobs of requests that ask (engine/prompt_logprobs.py).
    prompt_scores: list[PromptScores] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # Keep a few blocks free at admission so running sequences are not preempted at once.
        self.watermark_blocks = int(0.01 * block_manager.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found cached

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def num_running_seqs(self) -> int:
        return sum(r.num_seats for r in self.running)

    def release(self, seqs: list[Sequence]) -> None:
        """Give the sequences' blocks back to the pool (the only caller of `BlockManager.free`)."""
        for seq in seqs:
            self.block_manager.free(seq)

    def finish_request(self, request: Request) -> None:
        """Free the blocks of every sequence and drop the request from the queues."""
        self.release(request.seqs)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]

    # ---- one step ----------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _preempt(self, request: Request) -> None:
        self.block_manager.events.record("preempt", req=request.request_id)
        self.release(request.live_seqs())
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        chosen: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            items = self._schedule_running(self.running[index], budget, out)
            if items is None:  # the request gave up its own blocks: nothing of it runs, nor after it
                break
            chosen += items
            budget -= sum(item.num_new_tokens for item in items)
            index += 1
        if not out.num_preempted and not out.unservable:
            self._admit(chosen, budget, out)
        for item in chosen:
            (out.decodes if item.num_new_tokens == 1 else out.prefills).append(item)
        # Copies into blocks of a request preempted later in this step are harmless: nothing reads them.
        return out

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> list[ScheduledSeq] | None:
        """The running request's next tokens within `budget`; None when making room cost it its own blocks."""
        items: list[ScheduledSeq] = []
        for seq in request.live_seqs():
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                continue
            if not self._make_room(request, seq, num_new, out):
                return None
            out.block_copies += self.block_manager.allocate_slots(seq, num_new)
            items.append(ScheduledSeq(seq, request, num_new))
            budget -= num_new
        return items

    def _make_room(self, request: Request, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until `seq` fits; False when `request` itself had to go."""
        while not self.block_manager.can_allocate(seq, num_new):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                # Alone and still out of blocks: waiting cannot help. The up-front size check
                # should make this unreachable; drop the request rather than stop the engine.
                self.finish_request(request)
                out.unservable.append(request)
                return False
            self._preempt(victim)
            out.num_preempted += 1
            if victim is request:
                return False
        return True

    def _admit(self, chosen: list[ScheduledSeq], budget: int, out: SchedulerOutput) -> None:
        bm = self.block_manager
        seats = self.num_running_seqs()
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if seats + request.num_seats > self.max_num_seqs:
                break
            admitted = False
            for seq in request.live_seqs():
                hits = bm.match_prefix(seq) if not seq.block_table else []
                limit = cacheable_prompt_tokens(request)
                if limit is not None:  # cached positions would never be scored
                    hits = hits[: limit // bm.block_size]
                start = len(hits) * bm.block_size if hits else seq.num_computed_tokens
                remaining = seq.num_tokens - start
                num_new = remaining if remaining <= budget else (budget if self.enable_chunked_prefill else 0)
                if num_new == 0:
                    break
                needed = bm.blocks_to_admit(seq, hits, start + num_new)
                # The watermark guards running sequences; with none running, use the whole pool.
                watermark = self.watermark_blocks if self.running or chosen else 0
                if needed + watermark > bm.num_free_blocks:
                    break
                if hits:
                    bm.adopt_prefix(seq, hits)
                if not request.prefix_lookup_done:
                    request.prefix_lookup_done = True
                    request.num_cached_tokens = len(hits) * bm.block_size
                    self.prefix_cache_queries += seq.prompt_len
                    self.prefix_cache_hits += request.num_cached_tokens
                out.block_copies += bm.allocate_slots(seq, num_new)
                chosen.append(ScheduledSeq(seq, request, num_new))
                budget -= num_new
                admitted = True
            if not admitted:
                break
            self.waiting.popleft()
            self.running.append(request)
            seats += request.num_seats
