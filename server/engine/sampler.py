"""Turns one step's logits into tokens: penalties, greedy / temperature / top-k / top-p / min-p
sampling with per-request generators, and log-probabilities.

Sampling inverts each row's cumulative distribution at one uniform number, so every row draws
exactly one number per step: a seeded request draws it from its own generator and gets the same
tokens whatever else is in the batch. (A vocabulary-wide noise draw per row, as in the exponential
race, cost ~1.5 ms a row on CPU: a third of a 16-row decode step.) Rows without top-k / top-p /
min-p take one native pass (`cpu_native.sample_rows`: 0.44 -> 0.19 ms for one row at a 49k
vocabulary, 2.5 -> 1.0 ms for 16); filtered rows, and CPUs without the kernels, take torch's ops,
which are that pass's oracle in tests.

On CPU, a step whose rows need nothing else (no penalties, bias, filters or top log-probabilities:
most decode steps) takes one native pass for its tokens and their log-probabilities
(`cpu_native.sample_plain`), with no torch op around it: the same tokens and values as the path below.
Otherwise penalties, greedy choice and log-probabilities run where the logits are (the GPU on CUDA);
only the rows that sample go to the CPU, where the per-request CPU generators give the same tokens on
any device. A greedy batch moves a few numbers per row, not [rows, vocab] logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagoda.kernels import cpu_native
from pagoda.server.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token (raw model distribution)
    top_logprobs: list[dict[int, float] | None]  # chosen + top-k, for rows that asked


def apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    token_lists: list[tuple[list[int], list[int]]],
) -> None:
    """In place. Repetition penalty (transformers/vLLM semantics) over prompt + output tokens;
    presence and frequency penalties (OpenAI semantics) over output tokens."""
    vocab = logits.shape[-1]
    for row, p, (prompt_ids, output_ids) in zip(rows, params, token_lists, strict=True):
        line = logits[row]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=line.device
            )
            values = line[seen]
            line[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if output_ids and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            counts = torch.bincount(torch.tensor(output_ids, device=line.device), minlength=vocab)[:vocab]
            line -= p.frequency_penalty * counts.to(line.dtype)
            line -= p.presence_penalty * (counts > 0).to(line.dtype)


def apply_logit_bias(line: torch.Tensor, bias: dict[int, float]) -> None:
    """In place, OpenAI semantics: each value is added to its token's logit (±100 bans or forces it)."""
    ids = torch.tensor(list(bias), dtype=torch.long, device=line.device)
    line[ids] += torch.tensor(list(bias.values()), dtype=line.dtype, device=line.device)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop |= before >= top_p[:, None]  # keeps at least the first token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [rows, vocab] in the model dtype: widened to fp32 here, row by row natively
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        token_lists: list[tuple[list[int], list[int]]] | None = None,  # (prompt, output) ids per row
    ) -> SamplerOutput:
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        # A step's only draws: one per sampling row, each from its row's generator or this sampler's.
        uniform = self._draw([generators[i] for i in random_rows]) if random_rows else None
        vocab = logits.shape[-1]
        if not any(p.needs_penalties or p.logit_bias or p.logprobs or _filters(p, vocab) for p in params):
            plain = self._plain(logits, params, random_rows, uniform)
            if plain is not None:
                return plain
        logits = raw = logits.float()  # returned logprobs are of the raw model distribution
        penalty_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        if penalty_rows or bias_rows:
            logits = logits.clone()  # the raw logits still give the returned logprobs
        if penalty_rows:
            assert token_lists is not None
            apply_penalties(
                logits,
                penalty_rows,
                [params[i] for i in penalty_rows],
                [token_lists[i] for i in penalty_rows],
            )
        for i in bias_rows:
            apply_logit_bias(logits[i], params[i].logit_bias)
        greedy_ids, log_norm = argmax_and_log_norm(raw)
        if len(random_rows) == len(params):  # every row samples: no row copies
            chosen = self._sample(logits.cpu(), params, uniform).to(logits.device)
        elif logits is raw:
            chosen = greedy_ids
        else:  # penalties or a bias moved the maximum
            chosen = logits.argmax(dim=-1)
        if random_rows and len(random_rows) < len(params):
            sampled = self._sample(logits[random_rows].cpu(), [params[i] for i in random_rows], uniform)
            chosen[random_rows] = sampled.to(chosen.device)
        chosen_list = chosen.tolist()
        # The chosen token's log-probability without writing out the whole log-softmax.
        chosen_logprobs = (raw.gather(1, chosen[:, None]).squeeze(1) - log_norm).tolist()
        top: list[dict[int, float] | None] = [None] * len(params)
        max_k = max((p.logprobs or 0 for p in params), default=0)
        top_values = top_ids = None
        if max_k > 0:
            top_values, top_ids = torch.log_softmax(raw, dim=-1).topk(max_k, dim=-1)
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            entry = {chosen_list[i]: chosen_logprobs[i]}
            if p.logprobs > 0:
                entry.update(zip(top_ids[i][: p.logprobs], top_values[i][: p.logprobs], strict=True))
            top[i] = entry
        return SamplerOutput(chosen_list, chosen_logprobs, top)

    def _plain(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        random_rows: list[int],
        uniform: torch.Tensor | None,
    ) -> SamplerOutput | None:
        """Rows that need only their token and its log-probability, in one native pass (None: the
        kernel leaves them to torch's ops)."""
        temps, draws = [0.0] * len(params), [0.0] * len(params)
        for i, u in zip(random_rows, uniform.tolist() if uniform is not None else [], strict=True):
            temps[i], draws[i] = params[i].temperature, u
        plain = cpu_native.sample_plain(logits, temps, draws)
        if plain is None:
            return None
        token_ids, logprobs = plain
        rows = zip(params, token_ids, logprobs, strict=True)
        top = [None if p.logprobs is None else {t: lp} for p, t, lp in rows]
        return SamplerOutput(token_ids, logprobs, top)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        top_k_or_p = any(_top_k_or_p(p, vocab) for p in params)
        uses_min_p = any(p.min_p > 0 for p in params)
        if not (top_k_or_p or uses_min_p):  # the plain distribution in one pass (torch's ops: its oracle)
            native = cpu_native.sample_rows(logits, temps, uniform)
            if native is not None:
                return native
        logits = logits / temps[:, None]
        if top_k_or_p:
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
            logits = _filter_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        if uses_min_p:
            min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return sample_from_cdf(probs, uniform)

    def _draw(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One uniform number per row: a seeded row's from its own generator, the others' from this
        sampler's."""
        if all(g is None for g in generators):  # the same numbers as below, in one op
            return torch.rand(len(generators), dtype=torch.float64, generator=self.default_generator)
        uniform = torch.empty(len(generators), dtype=torch.float64)  # 53 random bits a draw
        shared = [row for row, g in enumerate(generators) if g is None]
        if shared:  # one draw for every unseeded row
            uniform[shared] = torch.rand(len(shared), dtype=torch.float64, generator=self.default_generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                uniform[row] = torch.rand(1, dtype=torch.float64, generator=generator)
        return uniform


def _top_k_or_p(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether a sampling row keeps less than its whole distribution (top-k, top-p, min-p)."""
    return not p.greedy and (_top_k_or_p(p, vocab) or p.min_p > 0)


def argmax_and_log_norm(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first maximal index and its logsumexp: one native pass on CPU, torch's ops elsewhere."""
    native = cpu_native.argmax_logsumexp(logits)
    return native if native is not None else (logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1))


def sample_from_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds uniform[i] × the row's total.
    A token of probability 0 adds nothing to the running sum, so it is never the first to exceed it."""
    cdf = probs.cumsum(dim=-1)  # fp32: ~1e-5 of mass misplaced at worst over a 150k vocabulary
    total = cdf[:, -1:]
    # Strictly below the total (a draw near 1 rounds up to it in fp32): the last nonzero token exceeds it.
    targets = torch.minimum(uniform.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(1)
