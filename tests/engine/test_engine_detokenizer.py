"""Incremental detokenization never splits a multi-byte character."""

from __future__ import annotations

import itertools

from pagoda.server.engine.detokenizer import IncrementalDetokenizer, text_decoder

TEXT = " Café, naïve, 東京 and 🙂 in München — ok"


def test_incremental_text_equals_full_decode_and_never_shows_replacement_chars(llama):
    tok = llama.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    # Byte-level BPE: the emoji and CJK characters span several tokens here.
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"), stop_strings=[])
    text = ""
    seen = []
    for token in ids:
        detok.append(token)
        text += detok.take(finished=False)  # deltas: what is new since the last take
        assert "\ufffd" not in text
        seen.append(text)
    assert text == tok.decode(ids)
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))  # only ever grows


def test_stop_string_is_held_back_while_it_could_still_match(llama):
    tok = llama.tokenizer
    ids = tok.encode(" The quick brown fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop_strings=["brown fox"])
    stopped = None
    visible = ""
    for token in ids:
        stopped = detok.append(token)
        visible += detok.take(finished=stopped is not None)
        assert "brown" not in visible or stopped
        if stopped:
            break
    assert stopped == "brown fox" and visible == " The quick "


def test_text_decoder_equals_the_tokenizers_decode(tiny, smollm2):
    """The direct backend decode gives exactly transformers' `decode(..., skip_special_tokens=True)`,
    special tokens and split multi-byte characters included; clean-up on keeps transformers' path."""
    for tok in (tiny("llama").tokenizer, tiny("qwen3").tokenizer, smollm2.tokenizer):
        decode = text_decoder(tok)
        assert decode.func == tok._tokenizer.decode  # the fast path is the one taken
        ids = tok.encode(TEXT, add_special_tokens=False)
        special = sorted(tok.all_special_ids)
        for piece in (ids, ids[:3], ids[1:-2], special + ids[:5] + special, []):
            assert decode(piece) == tok.decode(piece, skip_special_tokens=True)

    class CleaningUp:
        clean_up_tokenization_spaces = True
        _tokenizer = object()

        def decode(self, ids, skip_special_tokens=False):
            return "cleaned"

    assert text_decoder(CleaningUp())([1]) == "cleaned"
