"""The rules a request must meet, in one place, for the offline API and the server alike.

`check_sampling` holds every bound on the sampling parameters (`SamplingParams.validate` calls it);
`check_request` adds the rules that need the engine (its context length, the embedding rows the
model can index, the batch seats) and `check_pool` the KV pool's size. A broken rule raises `RequestError(param, message, code)`: the server
answers it as OpenAI's 400 with `param` and `code`, the offline API raises it (a `ValueError` whose
text reads "param: message").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from pagoda.server.engine.sampling_params import SamplingParams

MAX_N = 16  # sequences per request; more is almost always a client bug and multiplies KV use
MAX_LOGPROBS = 20  # top-k log-probabilities per token, as in vLLM
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_SEQUENCES = 16
MAX_TEMPERATURE = 2.0  # OpenAI's bound
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestError(ValueError):
    """A request broke a rule: `param` names the field, `code` is OpenAI's error code if it has one."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
        self.code = code


def _check(ok: bool, param: str, message: str, code: str | None = None) -> None:
    if not ok:
        raise RequestError(param, message, code)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def all_ints(values: Sequence[Any]) -> bool:
    """`is_int` of every value: one C pass over a prompt's thousands of ids (checked on the server's
    event loop) when they are all plain ints, `is_int` itself for anything else."""
    return set(map(type, values)) <= {int} or all(map(is_int, values))


def is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _in_range(param: str, value: Any, lo: float, hi: float) -> None:
    _check(
        is_number(value) and lo <= value <= hi, param, f"must be a number in [{lo:g}, {hi:g}], got {value!r}"
    )


def _int_in_range(param: str, value: Any, lo: int, hi: int) -> None:
    _check(is_int(value) and lo <= value <= hi, param, f"must be an integer in [{lo}, {hi}], got {value!r}")


def check_choices(n: Any, best_of: Any) -> None:
    """n sequences, or best_of of which the n best are kept: 1 <= n <= best_of <= MAX_N."""
    _check(is_int(n) and 1 <= n <= MAX_N, "n", f"must be an integer >= 1 and <= {MAX_N}, got {n!r}")
    if best_of is not None:
        _check(is_int(best_of) and n <= best_of <= MAX_N, "best_of",
               f"must be an integer in [n ({n}), {MAX_N}], got {best_of!r}")  # fmt: skip


def check_logprobs(param: str, value: Any) -> None:
    """None (off) or how many top log-probabilities per token."""
    if value is not None:
        _int_in_range(param, value, 0, MAX_LOGPROBS)


def check_sampling(p: SamplingParams) -> None:
    """Every bound on the sampling parameters."""
    check_choices(p.n, p.best_of)
    if p.max_tokens is not None:
        _check(is_int(p.max_tokens) and p.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1 (or None), got {p.max_tokens!r}")  # fmt: skip
    _check(is_number(p.temperature) and 0.0 <= p.temperature <= MAX_TEMPERATURE, "temperature",
           f"must be >= 0 and <= {MAX_TEMPERATURE:g}, got {p.temperature!r}")  # fmt: skip
    _check(is_number(p.top_p) and 0.0 < p.top_p <= 1.0, "top_p", f"must be in (0, 1], got {p.top_p!r}")
    _check(is_int(p.top_k) and p.top_k >= -1, "top_k",
           f"must be -1 (off), 0 (off) or a positive integer, got {p.top_k!r}")  # fmt: skip
    _in_range("min_p", p.min_p, 0.0, 1.0)
    _in_range("presence_penalty", p.presence_penalty, -2.0, 2.0)
    _in_range("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    _check(is_number(p.repetition_penalty) and p.repetition_penalty > 0.0, "repetition_penalty",
           f"must be > 0, got {p.repetition_penalty!r}")  # fmt: skip
    check_logprobs("logprobs", p.logprobs)
    check_logprobs("prompt_logprobs", p.prompt_logprobs)
    _check_logit_bias(p.logit_bias)
    if p.seed is not None:
        _int_in_range("seed", p.seed, *SEED_RANGE)
    _check(all(isinstance(s, str) and s for s in p.stop_strings), "stop",
           "must be a non-empty string or a list of non-empty strings")  # fmt: skip
    _check(len(p.stop_strings) <= MAX_STOP_SEQUENCES, "stop", f"at most {MAX_STOP_SEQUENCES} sequences")
    _check(all(is_int(t) and t >= 0 for t in p.stop_token_ids or []), "stop_token_ids",
           "must be a list of non-negative integers")  # fmt: skip
    if p.best_of is not None and p.best_of > p.n:
        _check(p.use_beam_search, "best_of", "best_of > n is only supported with use_beam_search")
    if p.use_beam_search:
        _check(p.greedy, "temperature", "must be 0 with use_beam_search")
        _check(p.top_p == 1.0 and p.top_k in (-1, 0) and p.min_p == 0.0, "use_beam_search",
               "top_p, top_k and min_p must be off")  # fmt: skip
        _check(not p.needs_penalties, "use_beam_search", "penalties are not supported")


def _check_logit_bias(bias: dict | None) -> None:
    if not bias:
        return
    _check(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} token ids")
    for token_id, value in bias.items():
        _check(is_int(token_id) and token_id >= 0, "logit_bias",
               f"keys must be non-negative token ids, got {token_id!r}")  # fmt: skip
        _check(is_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS, "logit_bias",
               f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r} for token {token_id}")  # fmt: skip


def check_logit_bias_vocab(bias: dict | None, vocab_size: int) -> None:
    _check(all(t < vocab_size for t in bias or {}), "logit_bias", f"token ids must be in [0, {vocab_size})")


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """`vocab_size`: the embedding rows the model can index (what a token id may be below)."""
    _check(len(prompt_ids) > 0, "prompt", "must not be empty")
    _check(all_ints(prompt_ids) and min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size, "prompt",
           f"token ids must be integers in [0, {vocab_size})")  # fmt: skip
    _check(len(prompt_ids) < max_model_len, "prompt",
           f"{len(prompt_ids)} tokens leave no room for output within the model's maximum context length "
           f"of {max_model_len} tokens", CONTEXT_LENGTH_EXCEEDED)  # fmt: skip


def check_max_tokens_fit(max_tokens: int | None, prompt_len: int, max_model_len: int) -> None:
    """OpenAI's rule for a max_tokens the client gave: it must fit in the context with the prompt.
    (A default, or the offline API's, is cut at the context length: the output ends with "length".)"""
    if max_tokens is None:
        return
    _check(prompt_len + max_tokens <= max_model_len, "max_tokens",
           f"the model's maximum context length is {max_model_len} tokens; {prompt_len + max_tokens} were "
           f"requested ({prompt_len} in the prompt, {max_tokens} for the completion). Reduce the prompt or "
           "max_tokens.", CONTEXT_LENGTH_EXCEEDED)  # fmt: skip


class EngineLimits(NamedTuple):
    vocab_size: int  # the embedding rows: every token id must be below this
    max_model_len: int
    max_num_seqs: int


def check_request(
    params: SamplingParams, prompt_ids: Sequence[int], limits: EngineLimits, max_tokens_must_fit: bool
) -> int:
    """Every rule on one request but the pool's; returns its most tokens (prompt + output)."""
    params.validate()
    check_prompt(prompt_ids, limits.vocab_size, limits.max_model_len)
    if max_tokens_must_fit:
        check_max_tokens_fit(params.max_tokens, len(prompt_ids), limits.max_model_len)
    check_logit_bias_vocab(params.logit_bias, limits.vocab_size)
    _check(params.num_seqs <= limits.max_num_seqs, "n",
           f"{params.num_seqs} sequences exceed max_num_seqs {limits.max_num_seqs}")  # fmt: skip
    return min(len(prompt_ids) + (params.max_tokens or limits.max_model_len), limits.max_model_len)


def check_pool(needed: int, pool: int, prompt_len: int, max_total: int, width: int) -> None:
    """A request that needs more KV blocks than the whole pool holds can never run."""
    _check(needed <= pool, "prompt",
           f"this request needs up to {needed} KV blocks ({prompt_len} prompt tokens, {max_total - prompt_len} "
           f"output tokens, {width} sequence(s)) but the pool has {pool}; lower max_tokens or give the KV "
           "cache more memory")  # fmt: skip
