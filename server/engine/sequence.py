"""Sequences (one token stream with its block table) and requests (a group of sequences)."""

from __future__ import annotations

import itertools

import torch
from pagoda.server.engine.detokenizer import IncrementalDetokenizer
from pagoda.server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.server.engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class Sequence:
    """One token stream. Its KV lives in the blocks of `block_table`; `num_computed_tokens` of its
    tokens are in the cache, the rest (a prompt, a prompt chunk, or the last sampled token) are
    run by the next steps."""

    def __init__(
        self, index: int, token_ids: list[int], prompt_len: int, detokenizer: IncrementalDetokenizer
    ):
        self.seq_id = next(_seq_ids)
        self.request_id = ""  # the owning request's id (set by Request; names the owner in KV views)
        self.index = index  # position in the request's outputs
        self.token_ids = token_ids
        self.prompt_len = prompt_len
        self.finished = False  # set once: a finished sequence holds no blocks after its step
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks (content-determined)
        self.num_registered_blocks = 0  # leading full blocks already offered to the prefix cache
        self.detokenizer = detokenizer
        self.output_logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        self.num_sent_tokens = 0  # output tokens already handed out (outputs are deltas)
        self.finish_sent = False

    def take_delta(self, index: int, want_logprobs: bool, final: bool) -> CompletionOutput | None:
        """What is new since the last delta (None when nothing is; `final`: the request's last output,
        which lists every sequence)."""
        start = self.prompt_len + self.num_sent_tokens
        token_ids = self.token_ids[start:]
        text = self.detokenizer.take(self.finished)
        if not token_ids and not text and (self.finish_sent or not self.finished) and not final:
            return None
        self.num_sent_tokens += len(token_ids)
        self.finish_sent = self.finished
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.output_logprobs[start - self.prompt_len :] if want_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def copy(self, index: int) -> Sequence:
        """The same tokens and scores, holding no blocks (`BlockManager.fork` shares the blocks too)."""
        detokenizer = self.detokenizer.copy() if self.detokenizer is not None else None
        child = Sequence(index, list(self.token_ids), self.prompt_len, detokenizer)
        child.request_id = self.request_id
        child.finished = self.finished
        child.output_logprobs = list(self.output_logprobs)
        child.cumulative_logprob = self.cumulative_logprob
        child.num_sent_tokens = self.num_sent_tokens
        return child


class Request:
    """A request: its prompt, parameters and the sequences generating its outputs."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        first_seq: Sequence,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.seqs: list[Sequence] = [first_seq]
        first_seq.request_id = request_id
        self.forked = params.n == 1 and not params.use_beam_search  # n > 1 forks after the prompt
        self.num_cached_tokens = 0
        self.prefix_lookup_done = False
        self.finished_beams: list[tuple[float, Sequence]] = []  # beam search: (score, hypothesis), best first
        self.beam_improvable = True  # beam search: can running beams still beat the finished ones?
        self.pending_beam_logits: dict[int, torch.Tensor] = {}  # beam search: beam index -> its logits
        self.first_output_sent = False
        # prompt_logprobs: per prompt position {its token: logprob, + top-k} (None for the first) and
        # its token's rank; filled chunk by chunk (engine/prompt_logprobs.py).
        wants_prompt = params.prompt_logprobs is not None
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if wants_prompt else None
        self.prompt_token_ranks: list[int | None] | None = [None] if wants_prompt else None

    @property
    def num_seats(self) -> int:
        """Sequences this request occupies in the running batch (reserved before forking)."""
        if not self.forked:
            return self.params.num_seqs
        return sum(1 for s in self.seqs if not s.finished)

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def take_output(self) -> RequestOutput | None:
        """What is new since the previous output (None when nothing is). Beam search hands out its
        best beams once, when finished: until then a beam's tokens may still be replaced."""
        finished = self.finished
        if self.params.use_beam_search:
            if not finished:
                return None
            seqs = list(enumerate(self.seqs[: self.params.n]))  # best first; index = rank
        else:
            seqs = [(seq.index, seq) for seq in sorted(self.seqs, key=lambda s: s.index)]
        want_logprobs = self.params.logprobs is not None
        outputs = [
            delta
            for index, seq in seqs
            if (delta := seq.take_delta(index, want_logprobs, final=finished)) is not None
        ]
        if not outputs and not finished:
            return None
        first, self.first_output_sent = not self.first_output_sent, True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics.snapshot(),
            prompt_logprobs=self.prompt_logprobs if first else None,
            prompt_token_ranks=self.prompt_token_ranks if first else None,
        )
