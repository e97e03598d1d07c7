"""Per-request sampling parameters and their validation (the engine validates before scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Upper bound on `logprobs` (top-k log-probabilities returned per output token), as in vLLM.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value
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
        """Raise ValueError("<param>: <what is wrong>") for anything the engine cannot serve."""
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                f"must be an integer >= 1 (or None), got {self.max_tokens!r}",
            )
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.logprobs is not None:
            _check(
                isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
            )
        if self.prompt_logprobs is not None:
            _check(
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
            )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(
                isinstance(token_id, int) and token_id >= 0,
                "logit_bias",
                f"keys must be non-negative token ids, got {token_id!r}",
            )
            _check(
                isinstance(bias, (int, float)) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} for token {token_id}",
            )
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(
            all(isinstance(s, str) and s for s in self.stop_strings),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        if self.best_of is not None:
            _check(
                isinstance(self.best_of, int) and self.best_of >= self.n,
                "best_of",
                f"must be an integer >= n ({self.n}), got {self.best_of!r}",
            )
            _check(
                self.best_of == self.n or self.use_beam_search,
                "best_of",
                "best_of > n is only supported with use_beam_search",
            )
        if self.use_beam_search:
            _check(self.greedy, "temperature", "must be 0 with use_beam_search")
            _check(
                self.top_p == 1.0 and self.top_k in (-1, 0) and self.min_p == 0.0,
                "use_beam_search",
                "top_p, top_k and min_p must be off",
            )
            _check(not self.needs_penalties, "use_beam_search", "penalties are not supported")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{param}: {message}")
