"""The server and the offline API refuse the same bad inputs, naming the same parameter: both go
through the engine's one set of rules (server/engine/validation.py)."""

from __future__ import annotations

import pytest
from conftest import TINY_ENGINE
from pagoda.server.engine.llm import LLM
from pagoda.server.engine.sampling_params import SamplingParams
from pagoda.server.engine.validation import MAX_N, RequestError

VOCAB = "vocab"  # stands for the model's embedding rows, known once it is loaded

# (name, prompt, SamplingParams fields = the same /v1/completions fields, param, code)
BAD = [
    ("empty prompt", "", {}, "prompt", None),
    ("token id = embedding rows", [5, VOCAB], {}, "prompt", None),
    ("negative token id", [5, -1], {}, "prompt", None),
    ("prompt fills the context", [5] * TINY_ENGINE["max_model_len"], {}, "prompt", "context_length_exceeded"),
    ("temperature negative", "Hi", {"temperature": -0.5}, "temperature", None),
    ("temperature above 2", "Hi", {"temperature": 2.5}, "temperature", None),
    ("top_p zero", "Hi", {"top_p": 0.0}, "top_p", None),
    ("top_p above 1", "Hi", {"top_p": 1.5}, "top_p", None),
    ("top_k below -1", "Hi", {"top_k": -2}, "top_k", None),
    ("min_p above 1", "Hi", {"min_p": 1.5}, "min_p", None),
    ("presence_penalty above 2", "Hi", {"presence_penalty": 2.5}, "presence_penalty", None),
    ("frequency_penalty below -2", "Hi", {"frequency_penalty": -3.0}, "frequency_penalty", None),
    ("repetition_penalty zero", "Hi", {"repetition_penalty": 0.0}, "repetition_penalty", None),
    ("n zero", "Hi", {"n": 0}, "n", None),
    ("n above the cap", "Hi", {"n": MAX_N + 1}, "n", None),
    ("n above the batch seats", "Hi", {"n": TINY_ENGINE["max_num_seqs"] + 1}, "n", None),
    ("best_of below n", "Hi", {"n": 3, "best_of": 2}, "best_of", None),
    ("max_tokens negative", "Hi", {"max_tokens": -3}, "max_tokens", None),
    ("logprobs above 20", "Hi", {"logprobs": 21}, "logprobs", None),
    ("prompt_logprobs above 20", "Hi", {"prompt_logprobs": 21}, "prompt_logprobs", None),
    ("seed beyond 64 bits", "Hi", {"seed": 2**64}, "seed", None),
    ("empty stop string", "Hi", {"stop": ["ok", ""]}, "stop", None),
    ("too many stop strings", "Hi", {"stop": [f"s{i}" for i in range(17)]}, "stop", None),
    ("negative stop token id", "Hi", {"stop_token_ids": [-1]}, "stop_token_ids", None),
    ("logit_bias above 100", "Hi", {"logit_bias": {5: 101.0}}, "logit_bias", None),
    ("logit_bias token = embedding rows", "Hi", {"logit_bias": {VOCAB: 1.0}}, "logit_bias", None),
]  # fmt: skip


@pytest.fixture(scope="module")
def offline(tiny_dir) -> LLM:
    return LLM(str(tiny_dir), **TINY_ENGINE)


def resolve(value, vocab: int):
    if value == VOCAB:
        return vocab
    if isinstance(value, list):
        return [resolve(v, vocab) for v in value]
    if isinstance(value, dict):
        return {resolve(k, vocab): resolve(v, vocab) for k, v in value.items()}
    return value


def wire(fields: dict) -> dict:
    """The same fields as JSON: logit_bias keys are strings of token ids."""
    if "logit_bias" in fields:
        return {**fields, "logit_bias": {str(k): v for k, v in fields["logit_bias"].items()}}
    return fields


@pytest.mark.parametrize(("name", "prompt", "fields", "param", "code"), BAD, ids=[row[0] for row in BAD])
def test_server_and_offline_refuse_alike(offline, server, http_request, name, prompt, fields, param, code):
    vocab = offline.engine.vocab_size
    assert vocab == server.state.engine.engine.vocab_size
    prompt, fields = resolve(prompt, vocab), resolve(fields, vocab)

    with pytest.raises(RequestError) as info:
        offline.generate(prompt, SamplingParams(**fields))
    assert (info.value.param, info.value.code) == (param, code), str(info.value)

    answer = http_request(server.url, "POST", "/v1/completions", {"prompt": prompt, **wire(fields)})
    assert answer.status == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["message"] == str(info.value)  # one rule, one message


def test_the_last_embedding_row_is_a_valid_token_for_both(offline, server, http_request):
    """One vocabulary size: the embedding rows, not len(tokenizer)."""
    last = offline.engine.vocab_size - 1
    params = {"max_tokens": 2, "ignore_eos": True, "logit_bias": {last: 1.0}}
    (out,) = offline.generate([5, last], SamplingParams(**params))
    assert len(out.outputs[0].token_ids) == 2
    answer = http_request(server.url, "POST", "/v1/completions", {"prompt": [5, last], **wire(params)})
    assert answer.status == 200 and answer.json()["usage"]["completion_tokens"] == 2
