"""The random workload: prompts of given token lengths, optionally behind one shared prefix.

With a tokenizer, prompts are random token ids (sent as ids to /v1/completions, so their length is
exact; decoded to text for chat). Without one, prompts are random words from a fixed list (about one
token per word for BPE tokenizers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_WORDS = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "foot",
    "boy",
    "age",
    "policy",
    "process",
    "music",
    "market",
    "sense",
    "nation",
    "plan",
    "college",
    "interest",
    "death",
    "experience",
    "effect",
    "use",
    "class",
    "control",
    "care",
    "field",
    "development",
    "role",
    "effort",
    "rate",
    "heart",
    "drug",
    "show",
    "leader",
    "light",
    "voice",
    "wife",
    "police",
    "mind",
    "price",
    "report",
    "decision",
    "son",
    "view",
    "relationship",
    "town",
    "road",
    "arm",
    "difference",
    "value",
    "building",
    "action",
    "model",
    "season",
    "society",
    "tax",
    "director",
    "position",
    "player",
    "record",
    "paper",
    "space",
    "ground",
    "form",
    "event",
    "official",
    "matter",
    "center",
    "couple",
    "site",
    "project",
    "activity",
    "star",
    "table",
    "need",
    "court",
    "oil",
    "situation",
    "cost",
    "industry",
    "figure",
    "street",
    "image",
    "phone",
    "data",
    "picture",
    "practice",
    "piece",
    "land",
    "product",
    "doctor",
    "wall",
    "patient",
    "worker",
    "news",
    "test",
    "movie",
    "north",
    "love",
    "support",
    "technology",
    "step",
    "baby",
    "computer",
    "type",
    "attention",
    "film",
    "tree",
    "source",
    "organization",
    "hair",
    "window",
    "evidence",
    "population",
    "truth",
    "song",
    "energy",
    "page",
    "cause",
    "page",
    "garden",
    "river",
]


@dataclass
class BenchRequest:
    prompt: str | list[int]  # token ids when a tokenizer built it
    prompt_text: str  # for chat, and for servers that want text
    prompt_len: int  # exact with a tokenizer, estimated (words) without
    output_len: int


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def _vocab_ids(tokenizer: Any) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(len(tokenizer)) if i not in special]


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    shared_prefix_len: int = 0,
    seed: int = 0,
    tokenizer: Any = None,
) -> list[BenchRequest]:
    """`num_prompts` requests; input/output lengths uniform in [len·(1−r), len·(1+r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio must be in [0, 1)")
    rng = random.Random(seed)
    inputs = _lengths(rng, input_len, range_ratio, num_prompts)
    outputs = _lengths(rng, output_len, range_ratio, num_prompts)
    if tokenizer is not None:
        vocab = _vocab_ids(tokenizer)
        prefix = [rng.choice(vocab) for _ in range(shared_prefix_len)]
        requests = []
        for n_in, n_out in zip(inputs, outputs, strict=True):
            ids = prefix + [rng.choice(vocab) for _ in range(n_in)]
            requests.append(BenchRequest(ids, tokenizer.decode(ids), len(ids), n_out))
        return requests
    prefix_words = [rng.choice(_WORDS) for _ in range(shared_prefix_len)]
    requests = []
    for n_in, n_out in zip(inputs, outputs, strict=True):
        words = prefix_words + [rng.choice(_WORDS) for _ in range(n_in)]
        text = " ".join(words)
        requests.append(BenchRequest(text, text, len(words), n_out))
    return requests


def load_tokenizer(name: str) -> Any:
    """`default` (the embedded model's), an HF folder or a .gguf file; never downloads."""
    from pagoda.server.engine.loader import resolve_model_source
    from transformers import AutoTokenizer

    source = resolve_model_source(None if name == "default" else name)
    if source.kind == "gguf":
        return AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    return AutoTokenizer.from_pretrained(source.path)
