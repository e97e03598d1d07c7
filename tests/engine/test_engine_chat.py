"""Chat prompts: the model's template decides the special tokens, never the tokenizer on top of it."""

from __future__ import annotations

from pagoda.server.engine.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Hello, world!"}]


def test_a_template_that_writes_bos_gets_exactly_one(llama):
    llm = llama.llm(kv_cache_memory=8 << 20)
    tokenizer = llm.tokenizer
    bos = tokenizer.bos_token_id
    assert tokenizer.encode("Hello")[0] == bos  # this tokenizer adds BOS to plain text itself
    original = tokenizer.chat_template
    tokenizer.chat_template = "{{ bos_token }}" + original  # as Llama-2/3 templates do
    try:
        ids = llm.engine.encode_chat(MESSAGES)
    finally:
        tokenizer.chat_template = original
    assert ids[0] == bos and ids[1] != bos


def test_chat_runs_the_templated_prompt(llama):
    llm = llama.llm(kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (chat,) = llm.chat(MESSAGES, params)
    text = llm.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    (plain,) = llm.generate([llm.tokenizer.encode(text, add_special_tokens=False)], params)
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
