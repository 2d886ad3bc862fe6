"""Prompts, incremental detokenisation across multi-byte characters, stop strings."""

from __future__ import annotations

import pytest
from tiny import byte_tokenizer

from verispec.pipeline.text import TextAssembler, encode_messages, encode_prompt


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


TEXTS = ["héllo wörld — 你好, 🙂 ok", "plain ascii", "🙂🙂🙂", "a\nb\tc"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_streamed_pieces_concatenate_to_text(tok, text, chunk):
    ids = tok(text).input_ids
    assert len(ids) > len(text) or text.isascii()  # multi-byte chars really span tokens
    asm = TextAssembler(tok)
    pieces = [asm.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(asm.finish())
    assert "".join(pieces) == text == asm.text
    assert all("\ufffd" not in p for p in pieces)


def _stream_until_stop(asm: TextAssembler, ids: list[int], chunk: int) -> tuple[list[str], int | None]:
    """Commit `chunk` tokens at a time, as a round does, until the engine's stop callback fires. Returns the
    pieces shown (the final flush included) and how many tokens the callback kept."""
    shown, keep = [], None
    for i in range(0, len(ids), chunk):
        shown.append(asm.push(ids[i : i + chunk]))
        keep = asm.stop_index(ids[: i + chunk])
        if keep is not None:
            break
    shown.append(asm.finish())
    return shown, keep


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_cuts_text_and_tokens(tok, chunk):
    text = "one two STOP three"
    ids = tok(text).input_ids
    asm = TextAssembler(tok, stop=["STOP", "never"])
    shown, keep = _stream_until_stop(asm, ids, chunk)
    assert "".join(shown) == "one two " == asm.text
    assert keep == len(tok("one two STOP").input_ids)  # up to the token that completes the stop
    assert all("S" not in p for p in shown)  # nothing of the stop string was ever shown


def test_no_stop_returns_none(tok):
    asm = TextAssembler(tok, stop=["zzz"])
    assert asm.stop_index(tok("abc").input_ids) is None
    assert TextAssembler(tok).stop_index(tok("abc").input_ids) is None


def test_chat_prompt_uses_template(tok):
    ids = encode_prompt(tok, "hi", chat=True, system="be brief")
    text = tok.decode(ids)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert encode_messages(tok, [{"role": "user", "content": "hi"}]) == tok(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids


def test_chat_without_template_is_a_clear_error(tok):
    tok2 = byte_tokenizer()
    tok2.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tok2, "hi", chat=True)


@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
@pytest.mark.parametrize(
    "stops, text, expected",
    [
        (["xyz", "y"], "ab xyz cd", "ab x"),  # "y" is completed before "xyz"
        (["y", "xyz"], "ab xyz cd", "ab x"),  # the order of the list does not matter
        (["bcd", "abcdef"], "zabcdefg", "za"),  # nested: the inner one ends first
        (["cde", "abc"], "zabcdefg", "z"),  # overlapping: "abc" ends first although "cde" is listed first
        (["abcd", "bcd"], "zabcdefg", "z"),  # equal ends: the longer (earlier-starting) one
    ],
)
def test_the_stop_that_ends_first_wins_whatever_the_chunking(tok, chunk, stops, text, expected):
    """Plain decoding (chunk = 1) stops at the first stop string completed; a round that commits several
    tokens at once must stop at the same place and show the same text."""
    ids = tok(text).input_ids
    asm = TextAssembler(tok, stop=stops)
    shown, keep = _stream_until_stop(asm, ids, chunk)
    assert "".join(shown) == expected == asm.text
    plain_keep = next(n for n in range(1, len(ids) + 1) if TextAssembler(tok, stop=stops).stop_index(ids[:n]))
    assert keep == plain_keep
