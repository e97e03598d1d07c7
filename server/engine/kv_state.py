"""A consistent picture of the KV cache for `/kv/state`: every block, every sequence's block table,
the counters and the headline numbers. Read it where engine state cannot move (between two steps:
`AsyncLLMEngine.inspect`); the schema is documented in docs/kv.md and tested.

Blocks are columns (one list per field) so a pool of 100 000 blocks stays a small JSON document.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pagoda.server.engine.kv_events import KINDS, describe

if TYPE_CHECKING:
    from pagoda.server.engine.llm_engine import LLMEngine
    from pagoda.server.engine.sequence import Request

RECENT_EVENTS = 64


def _request_view(request: Request, status: str, block_size: int) -> dict[str, Any]:
    seqs = []
    for seq in request.live_seqs():
        seqs.append(
            {
                "seq_id": seq.seq_id,
                "index": seq.index,
                "block_table": list(seq.block_table),
                "tokens_in_cache": seq.num_computed_tokens,
                "tokens": seq.num_tokens,
                "prompt_tokens": seq.prompt_len,
                "output_tokens": seq.num_output_tokens,
                # the partly filled last block's empty slots: the waste paging bounds
                "empty_slots": len(seq.block_table) * block_size - seq.num_computed_tokens,
            }
        )
    return {
        "id": request.request_id,
        "status": status,
        "prompt_tokens": len(request.prompt_token_ids),
        "prefix_hit_tokens": request.num_cached_tokens,
        "seqs": seqs,
    }


def kv_snapshot(engine: LLMEngine, usage_target: float) -> dict[str, Any]:
    bm, scheduler = engine.block_manager, engine.scheduler
    size, n = bm.block_size, bm.num_blocks
    state = ["free"] * n
    ref_count = [0] * n
    owner: list[str | None] = [None] * n
    filled = [0] * n  # slots holding a token's K/V
    for block in bm.blocks:
        ref_count[block.block_id] = block.ref_count
        if block.ref_count > 0:
            state[block.block_id] = "used"
        elif block.block_hash is not None:
            state[block.block_id] = "cached"
            filled[block.block_id] = size
    requests = [_request_view(r, "running", size) for r in scheduler.running]
    requests += [_request_view(r, "waiting", size) for r in scheduler.waiting]
    lengths = [s.num_tokens for r in scheduler.running for s in r.live_seqs()]
    # Waiting requests too: a partly prefilled one may hold blocks while it waits.
    for request in [*scheduler.running, *scheduler.waiting]:
        for seq in request.live_seqs():
            for i, block_id in enumerate(seq.block_table):
                if owner[block_id] is None:
                    owner[block_id] = request.request_id
                held = min(size, max(0, seq.num_computed_tokens - i * size))
                filled[block_id] = max(filled[block_id], held)
    used = bm.num_used_blocks
    used_slots = used * size
    held_slots = sum(f for f, s in zip(filled, state, strict=True) if s == "used")
    mean_len = sum(lengths) / len(lengths) if lengths else None
    blocks_per_seq = bm.blocks_for(int(mean_len)) if mean_len else None
    log = engine.kv_events
    events = log.recent(RECENT_EVENTS)
    return {
        "time": time.time(),
        "step": engine.num_steps,
        "model": engine.model_name,
        "block_size": size,
        "num_blocks": n,
        "blocks": {"state": state, "ref_count": ref_count, "owner": owner, "filled": filled},
        "requests": requests,
        "counters": {
            **{f"{kind}_events": log.counts[kind] for kind in KINDS},
            "events_recorded": log.next_seq,
            "events_dropped": log.dropped,
            "evictions": bm.num_evictions,
            "preemptions": scheduler.num_preemptions,
            "prefix_cache_queries": scheduler.prefix_cache_queries,
            "prefix_cache_hits": scheduler.prefix_cache_hits,
        },
        "headline": {
            "blocks_used": used,
            "blocks_cached": bm.num_cached_free_blocks,
            "blocks_free": n - used - bm.num_cached_free_blocks,
            "blocks_shared": bm.num_shared_blocks,
            "usage": used / n,
            "usage_target": usage_target,
            "capacity_tokens": n * size,
            "mean_seq_tokens": mean_len,
            "capacity_seqs_at_mean_len": n // blocks_per_seq if blocks_per_seq else None,
            "waste_slots": used_slots - held_slots,
            "waste_pct": 100.0 * (used_slots - held_slots) / used_slots if used_slots else 0.0,
        },
        "roofline": {
            "peak_bytes_per_s": engine.roofline.peaks.bytes_per_s,
            "peak_flops_per_s": engine.roofline.peaks.flops_per_s,
            "ridge_intensity": engine.roofline.peaks.ridge_intensity,
            "peak_source": engine.roofline.peaks.source,
            "bound_steps": dict(engine.roofline.bound_steps),
            "last_step": engine.roofline.last.as_dict() if engine.roofline.last else None,
        },
        "recent_events": events,
        # what each event kind means, once here rather than in every event
        "kinds": {kind: describe(kind) for kind in KINDS},
    }
