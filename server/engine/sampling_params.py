"""Per-request sampling parameters (their bounds: `validation.py`, checked before scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.server.engine.validation import check_sampling

_EPS = 1e-5  # temperatures below this are treated as greedy


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None = up to max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per output token; 0 = only the chosen token's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    best_of: int | None = None  # beam search: beam width (defaults to n)
    length_penalty: float = 1.0  # beam search: score = cumulative logprob / length**length_penalty
    # Log-probabilities of the prompt tokens (top-k per position, the first token has none); None = off.
    # Such requests skip the prefix cache: every position they ask about is run.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before choosing
    # Normalised forms, filled by __post_init__.
    stop_strings: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def beam_width(self) -> int:
        return max(self.best_of or self.n, self.n)

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once: its beams, or its n samples."""
        return self.beam_width if self.use_beam_search else self.n

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """Raise `RequestError` (a ValueError naming the parameter) for anything the engine cannot serve."""
        check_sampling(self)
