"""Log-probabilities of prompt tokens, for the requests that ask (`SamplingParams.prompt_logprobs`).

The row of prompt position p holds the model's distribution of token p+1. For each prefill chunk of
such a request, only the rows whose next token is a prompt token not scored yet become logits (other
requests pay nothing; positions scored before a preemption are not scored again). Each scored
position gets {its token: logprob, plus the top-k} and its token's rank (1 = the likeliest); the first
prompt token has nothing before it and stays None. The scheduler lets no prefix-cache hit skip a
position still to be scored (`cacheable_prompt_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.server.engine.scheduler import SchedulerOutput
    from pagoda.server.engine.sequence import Request

ROWS_PER_SLICE = 256  # bounds the [rows, vocab] logits held at once for a long prompt


@dataclass
class PromptScores:
    """Consecutive prompt positions of one request, starting at `first`."""

    request: Request
    first: int
    entries: list[dict[int, float]]
    ranks: list[int]


def cacheable_prompt_tokens(request: Request) -> int | None:
    """How many leading tokens may come from the prefix cache (None: no limit).

    A cached position's row is never run, so it can only be skipped once the token after it is scored.
    """
    if request.prompt_logprobs is None:
        return None
    return len(request.prompt_logprobs) - 1


def _plan(out: SchedulerOutput) -> list[tuple[Request, int, list[int], list[int]]]:
    """(request, first target, packed rows, target token ids) per chunk that has positions to score.

    Rows follow the runner's packing: prefill chunks first, each chunk's tokens in order.
    """
    plans = []
    next_target: dict[str, int] = {}  # n > 1 recomputing after a preemption: score each position once
    offset = 0
    for item in out.prefills:
        request, seq = item.request, item.seq
        start, count = seq.num_computed_tokens, item.num_new_tokens
        if request.prompt_logprobs is not None:
            first = max(start + 1, next_target.get(request.request_id, len(request.prompt_logprobs)))
            end = min(start + count + 1, seq.prompt_len)  # targets p+1 of rows p in [start, start+count)
            if first < end:
                rows = [offset + target - 1 - start for target in range(first, end)]
                plans.append((request, first, rows, seq.token_ids[first:end]))
                next_target[request.request_id] = end
        offset += count
    return plans


def prompt_score_rows(out: SchedulerOutput) -> list[int]:
    """The packed rows whose logits `score_prompt_tokens` computes this step."""
    return [r for _, _, plan_rows, _ in _plan(out) for r in plan_rows]


def prompt_logit_slices(model, hidden: torch.Tensor, rows: list[int]):
    """(first row index, logits) per slice of `rows`. Under tensor parallelism every rank runs this
    with the same rows: the LM head is a collective."""
    index = torch.tensor(rows, device=hidden.device)
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        yield lo, model.compute_logits(hidden[index[lo : lo + ROWS_PER_SLICE]])


@torch.inference_mode()
def score_prompt_tokens(model, hidden: torch.Tensor, out: SchedulerOutput) -> list[PromptScores]:
    """Scores for every prompt position this step runs for a request that asks; [] when none asks."""
    plans = _plan(out)
    if not plans:
        return []
    rows = [r for _, _, plan_rows, _ in plans for r in plan_rows]
    targets = torch.tensor([t for _, _, _, plan_targets in plans for t in plan_targets], device=hidden.device)
    top_k = max(request.params.prompt_logprobs or 0 for request, _, _, _ in plans)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for lo, logits in prompt_logit_slices(model, hidden, rows):
        logprobs = torch.log_softmax(logits.float(), -1)
        own = logprobs.gather(1, targets[lo : lo + ROWS_PER_SLICE, None])
        chosen += own.squeeze(1).tolist()
        ranks += ((logprobs > own).sum(-1) + 1).tolist()
        if top_k:
            values, ids = logprobs.topk(top_k, dim=-1)
            top_values += values.tolist()
            top_ids += ids.tolist()
    scores, at = [], 0
    for request, first, plan_rows, plan_targets in plans:
        k = request.params.prompt_logprobs or 0
        entries = []
        for i, token in enumerate(plan_targets):
            entry = {token: chosen[at + i]}
            if k:
                entry.update(zip(top_ids[at + i][:k], top_values[at + i][:k], strict=True))
            entries.append(entry)
        scores.append(PromptScores(request, first, entries, ranks[at : at + len(plan_rows)]))
        at += len(plan_rows)
    return scores


def record(scores: list[PromptScores]) -> None:
    """Append each request's new positions (the plan made them follow on from what it has)."""
    for score in scores:
        request = score.request
        assert request.prompt_logprobs is not None and request.prompt_token_ranks is not None
        assert score.first == len(request.prompt_logprobs), (score.first, len(request.prompt_logprobs))
        request.prompt_logprobs.extend(score.entries)
        request.prompt_token_ranks.extend(score.ranks)
