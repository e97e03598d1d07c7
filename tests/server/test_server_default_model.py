"""The embedded default model (SmolLM2-135M-Instruct) answers a real question through the chat template."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def smollm(start_server):
    return start_server(model=None)


def test_default_model_answers_a_question(smollm):
    client = openai.OpenAI(base_url=smollm.url + "/v1", api_key="unused", max_retries=0)
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_completion_tokens=24,
        temperature=0,
    )
    answer = response.choices[0].message.content
    assert "Paris" in answer, answer
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_completion_tokens=24,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason
