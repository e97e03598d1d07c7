"""What evaluation harnesses and SDKs send to /v1/completions: echo with prompt logprobs (the first
token null), scoring only (`max_tokens: 0`), token-id prompt lists, vLLM's `prompt_logprobs`,
`logit_bias` and `best_of`. Prompt logprobs are checked against transformers on the same weights."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_token_logprobs(hf_model, ids: list[int]) -> list[float]:
    logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def complete(server, http_request, **body):
    result = http_request(server.url, "POST", "/v1/completions", body)
    assert result.status == 200, result.text
    return result.json()


PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42], [7] * 37]


def test_scoring_token_id_prompts_matches_transformers(server, http_request, hf_model):
    response = complete(server, http_request, prompt=PROMPTS, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choices = sorted(response["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for ids, choice in zip(PROMPTS, choices, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) and choice["finish_reason"] == "length"
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(hf_token_logprobs(hf_model, ids), abs=1e-4)
        assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert response["usage"]["completion_tokens"] == 0
    assert response["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    assert server.stats().num_blocks_used == 0


def test_echo_prepends_the_prompt_to_what_is_generated(server, http_request):
    kwargs = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = complete(server, http_request, logprobs=2, **kwargs)["choices"][0]
    echoed = complete(server, http_request, logprobs=2, echo=True, **kwargs)["choices"][0]
    assert echoed["text"] == kwargs["prompt"] + plain["text"]
    prompt_len = len(echoed["logprobs"]["tokens"]) - 3
    assert echoed["logprobs"]["tokens"][prompt_len:] == plain["logprobs"]["tokens"]
    assert echoed["logprobs"]["token_logprobs"][prompt_len:] == pytest.approx(plain["logprobs"]["token_logprobs"])
    assert echoed["logprobs"]["token_logprobs"][0] is None
    assert all(isinstance(lp, float) for lp in echoed["logprobs"]["token_logprobs"][1:])
    no_logprobs = complete(server, http_request, echo=True, **kwargs)["choices"][0]
    assert no_logprobs["text"] == echoed["text"] and no_logprobs["logprobs"] is None
    two = complete(server, http_request, echo=True, n=2, **{**kwargs, "temperature": 0.9, "seed": 1})
    assert all(c["text"].startswith(kwargs["prompt"]) for c in two["choices"]) and len(two["choices"]) == 2


def test_echo_streamed_sends_the_prompt_first(server, http_request):
    body = {"prompt": [30, 31, 32, 33], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 0}  # fmt: skip
    full = complete(server, http_request, **body)["choices"][0]
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:
        frames = [line.decode()[6:].strip() for line in response if line.startswith(b"data: ")]
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    assert "".join(c["text"] for c in chunks) == full["text"]
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert tokens == full["logprobs"]["tokens"] and len(chunks[0]["logprobs"]["tokens"]) >= 4


def test_vllm_prompt_logprobs(server, http_request, hf_model):
    ids = PROMPTS[0]
    choice = complete(server, http_request, prompt=ids, max_tokens=1, prompt_logprobs=2, temperature=0)["choices"][0]
    positions = choice["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    expected = hf_token_logprobs(hf_model, ids)
    for position, token, lp in zip(positions[1:], ids[1:], expected, strict=True):
        assert position[str(token)]["logprob"] == pytest.approx(lp, abs=1e-4)
        assert {v["rank"] for k, v in position.items() if k != str(token)} <= {1, 2}
        assert len(position) in (2, 3) and position[str(token)]["rank"] >= 1
    assert "prompt_logprobs" not in complete(server, http_request, prompt=ids, max_tokens=1)["choices"][0]


def test_logit_bias_through_the_openai_client(client, server):
    model = server.state.model_name
    response = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=0,
                                         logit_bias={"9": 100}, extra_body={"ignore_eos": True})  # fmt: skip
    token_text = server.state.engine.tokenizer.decode([9], skip_special_tokens=True)
    assert response.choices[0].logprobs.tokens == [token_text] * 4
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=3, temperature=0.7, seed=4, logprobs=True,
                                          logit_bias={"9": 100}, extra_body={"ignore_eos": True})  # fmt: skip
    assert [t.token for t in chat.choices[0].logprobs.content] == [token_text] * 3


def test_best_of_keeps_the_likeliest(server, http_request):
    kwargs = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    three = complete(server, http_request, n=3, logprobs=0, **kwargs)["choices"]
    scores = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in three}
    best = complete(server, http_request, best_of=3, **kwargs)
    assert len(best["choices"]) == 1 and best["choices"][0]["index"] == 0
    assert best["choices"][0]["text"] == max(scores, key=scores.get)
    assert best["usage"]["completion_tokens"] == 18  # every sequence the engine ran
    two_of_three = complete(server, http_request, n=2, best_of=3, **kwargs)["choices"]
    assert sorted(c["index"] for c in two_of_three) == [0, 1]
    assert {c["text"] for c in two_of_three} == set(sorted(scores, key=scores.get)[1:])
