"""Beam search over paged sequences, with the same selection rules as transformers' `num_beams`
search (length penalty, early-stop heuristic with early_stopping=False).

Beams are sequences of one request. A beam chosen by several continuations is forked (the children
share its blocks by ref count; their next writes copy the shared partial block); a beam chosen by
none is pruned: `step` returns it, and the engine has the scheduler release its blocks after the step.
"""

from __future__ import annotations

import torch
from pagoda.server.engine.block_manager import BlockManager
from pagoda.server.engine.sequence import Request, Sequence

_DEAD = -1.0e9  # transformers' score for impossible continuations


class BeamSearch:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager

    def step(
        self,
        request: Request,
        beams: list[Sequence],
        logits: torch.Tensor,
        eos_ids: set[int],
        max_model_len: int,
    ) -> list[Sequence]:
        """Advance the request's beams by one token; returns the pruned beams (finished, still holding blocks)."""
        params = request.params
        width = params.beam_width
        stop_ids = eos_ids | set(params.stop_token_ids or [])
        prompt_len = beams[0].prompt_len
        cur_len = beams[0].num_tokens
        max_length = min(prompt_len + (params.max_tokens or max_model_len), max_model_len)
        scores = torch.log_softmax(logits.float(), dim=-1)
        scores += torch.tensor([b.cumulative_logprob for b in beams])[:, None]
        vocab = scores.shape[-1]
        num_candidates = min(max(2, 1 + len(stop_ids)) * width, scores.numel())
        top_scores, top_index = scores.flatten().topk(num_candidates)
        candidates = [
            (score, index // vocab, index % vocab, index % vocab in stop_ids or cur_len + 1 >= max_length)
            for score, index in zip(top_scores.tolist(), top_index.tolist(), strict=True)
        ]
        penalty = params.length_penalty
        # New finished hypotheses: among the best `width` candidates only, while improvement is possible.
        if request.beam_improvable:
            for score, parent, token, hits_stop in candidates[:width]:
                if hits_stop:
                    normalised = score / ((cur_len + 1 - prompt_len) ** penalty)
                    reason = "stop" if token in stop_ids else "length"
                    stop_reason = token if token in (params.stop_token_ids or []) else None
                    hypothesis = self._hypothesis(beams[parent], token, score, reason, stop_reason)
                    request.finished_beams.append((normalised, hypothesis))
            request.finished_beams.sort(key=lambda entry: entry[0], reverse=True)
            del request.finished_beams[width:]
        running = [c for c in candidates if not c[3]][:width]
        if request.beam_improvable and running and len(request.finished_beams) == width:
            best_possible = running[0][0] / ((cur_len + 1 - prompt_len) ** penalty)
            request.beam_improvable = best_possible > request.finished_beams[-1][0]
        done = not request.beam_improvable or not running
        return self._advance(request, beams, [] if done else running)

    @staticmethod
    def _hypothesis(
        parent: Sequence, token: int, score: float, reason: str, stop_reason: int | None
    ) -> Sequence:
        """A finished copy of `parent` + `token` (holds no blocks)."""
        final = parent.copy(parent.index)
        final.token_ids.append(token)
        final.cumulative_logprob = score
        final.finished = True
        final.finish_reason, final.stop_reason = reason, stop_reason
        return final

    def _advance(self, request: Request, beams: list[Sequence], running: list) -> list[Sequence]:
        """Fork / prune the beams so they match the chosen continuations."""
        uses: dict[int, int] = {}
        for _, parent, _, _ in running:
            uses[parent] = uses.get(parent, 0) + 1
        new_beams: list[Sequence] = []
        children: dict[int, list[Sequence]] = {}
        for parent, count in uses.items():  # fork before any beam gets its new token
            kids = []
            for _ in range(count - 1):
                kids.append(self.block_manager.fork(beams[parent], beams[parent].index))
            children[parent] = [beams[parent], *kids]
        for score, parent, token, _ in running:
            beam = children[parent].pop()
            beam.token_ids.append(token)
            beam.cumulative_logprob = score
            new_beams.append(beam)
        pruned = [beam for index, beam in enumerate(beams) if index not in uses]
        for beam in pruned:
            beam.finished = True
        for index, beam in enumerate(new_beams):
            beam.index = index
        request.seqs = new_beams
        if not new_beams:
            self._finalise(request)
        return pruned

    @staticmethod
    def _finalise(request: Request) -> None:
        """The best hypotheses become the request's sequences (best first), with their text."""
        for _, hypothesis in request.finished_beams:
            for token in hypothesis.output_token_ids:
                hypothesis.detokenizer.append(token)
            hypothesis.detokenizer.flush()
        request.seqs = [h for _, h in request.finished_beams[: request.params.n]]
