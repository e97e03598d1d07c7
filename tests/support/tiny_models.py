"""Tiny random-weight models of each supported family, saved as real Hugging Face folders.

Each folder holds config.json, model.safetensors (or shards), generation_config.json and a real
fast tokenizer (byte-level BPE trained locally on a fixed text, ChatML-style chat template), so
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load it offline.

Families (`TINY_FAMILIES`):
- ``llama``:  Llama-2 style, MHA, untied embeddings, BOS prepended by the tokenizer.
- ``llama3``: GQA, llama3 rope scaling (small original context so the scaling changes frequencies),
  tied embeddings.
- ``mistral``: GQA, sliding_window=8 (prompts longer than 8 tokens exercise it).
- ``qwen2``:  GQA, q/k/v bias, tied embeddings, no BOS.
- ``qwen3``:  GQA, q/k RMSNorm, explicit head_dim (heads * head_dim != hidden), no BOS.

Weights are re-drawn with unit-scale variances (not the 0.02 HF init) so logits are O(1) and a
1e-4 logits tolerance actually tests something; norm weights and biases are random too.

Reuse from any test area's conftest (one line per family, cached on disk per pytest session):

    from support.tiny_models import tiny_model_dir
    @pytest.fixture(scope="session")
    def tiny_llama(tmp_path_factory): return tiny_model_dir("llama", tmp_path_factory)
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

TINY_FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")

BOS, EOS, IM_START, IM_END, PAD = "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TOKENIZER_TEXT = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
    "Once upon a time there was a small model that served tokens from a paged cache. "
    "Hello, world! How are you today? I am fine, thank you. 1 2 3 4 5 6 7 8 9 10. "
    "Attention is all you need; blocks of keys and values live in pages. "
    "Café, naïve, 東京, München, emoji 🙂 — multi-byte characters appear too.\n"
)
_VOCAB_SIZE = 320


def _build_tokenizer(add_bos: bool):
    """A byte-level BPE fast tokenizer, trained here on a fixed text (deterministic, no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer=trainer)
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )


def _family_config(family: str, tokenizer, num_layers: int, hidden: int, max_positions: int):
    """The transformers config of one family, shaped small."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD),
    }
    common: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        **ids,
    }
    if family == "llama":
        return LlamaConfig(
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
    if family == "llama3":
        return LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
    if family == "mistral":
        return MistralConfig(
            num_key_value_heads=2,
            sliding_window=8,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
    if family == "qwen2":
        return Qwen2Config(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **common,
        )
    if family == "qwen3":
        return Qwen3Config(
            num_key_value_heads=2,
            head_dim=32,  # 4 heads * 32 = 128 != hidden 64: the projections are not square
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **common,
        )
    raise ValueError(f"unknown tiny family {family!r}; expected one of {TINY_FAMILIES}")


def _randomize(model, seed: int) -> None:
    """Unit-scale random weights so the logits are O(1) and small numeric errors show."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.2 * noise)
            else:  # embeddings and Linear [out, in]: keep activations and (tied) logits ~unit scale
                param.copy_(noise / math.sqrt(param.shape[1]))


def make_tiny_model(
    family: str,
    path: Path | str,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 64,
    max_position_embeddings: int = 512,
    max_shard_size: str | None = None,
    num_kv_heads: int | None = None,
) -> Path:
    """Build the tiny `family` model with random weights and save it as an HF folder at `path`.

    `max_shard_size` (e.g. "20KB") saves sharded safetensors with model.safetensors.index.json;
    `num_kv_heads` overrides the family's (e.g. 1: multi-query attention).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {TINY_FAMILIES}")
    path = Path(path)
    tokenizer = _build_tokenizer(add_bos=family in ("llama", "llama3", "mistral"))
    config = _family_config(family, tokenizer, num_layers, hidden, max_position_embeddings)
    if num_kv_heads is not None:
        config.num_key_value_heads = num_kv_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    # Chat turns end with <|im_end|>: generation stops on either end token.
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=config.pad_token_id,
        do_sample=False,
    ).save_pretrained(path)
    return path


def tiny_model_dir(family: str, tmp_path_factory, **kwargs: Any) -> Path:
    """The tiny `family` folder, built once per pytest session under its base temp dir.

    Built in a scratch dir and renamed, so a concurrent caller never sees a half-written folder.
    `kwargs` go to `make_tiny_model` and are part of the cache key.
    """
    root = Path(tmp_path_factory.getbasetemp()) / "tiny_models"
    key = family + "".join(f"-{k}={v}" for k, v in sorted(kwargs.items()))
    target = root / key
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-"))
    make_tiny_model(family, scratch, **kwargs)
    try:
        scratch.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(scratch, ignore_errors=True)
    return target
