"""Prompts, incremental detokenisation across multi-byte characters, stop strings."""

from __future__ import annotations

import pytest
from tiny import byte_tokenizer

from verispec.pipeline.text import TextAssembler, encode_messages, encode_prompt, json_string_texts, prompt_strings


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


# -- the incremental text path against the one that decodes everything every round ---------------------------

UNICODE = ["héllo wörld — 你好, 🙂 ok", "🙂🙂🙂 👩‍👩‍👧 🇫🇷🇩🇪", "a\u0301 e\u0308 n\u0303 combining marks",
           "日本語のテキスト、中文，한국어", "tab\tnew\nline  double  space", "  leading and trailing  ",
           "ℌ𝔢𝔩𝔩𝔬 math 𝔁 and ﬁ ligature", "the quick brown fox jumps over the lazy dog"]


def run_text(make, ids: list[int], chunks: list[int], accepted: list[int]):
    """A text path (`make()`) driven as the engine and a stream drive it: per round the stop test on the generated
    ids (the round cut after a stop, as settle cuts it), then the round's tokens pushed; then the flush. Returns
    (tokens kept at a stop or None, the pieces, the final text, the ids the stop test had seen)."""
    text, generated, pieces, keep, at = make(), [], [], None, 0
    for n, a in zip(chunks, accepted):
        chunk = ids[at : at + n]
        if not chunk:
            break
        start = len(generated)
        generated += chunk
        at += n
        if text.stop_test is not None:
            keep = text.stop_test(generated)
        if keep is not None:
            chunk = chunk[: max(0, keep - start)]
        pieces.append(text.push(chunk, accepted=min(a, len(chunk))))
        if keep is not None:
            break
    pieces.append(text.finish())
    return keep, [(p.text, p.accepted, p.target, p.spans) for p in pieces if p is not None], text.text, len(generated)


def assert_same_text(tok, ids: list[int], stops: list[str], seed: int) -> None:
    """Under a seeded round chunking, the incremental path stops where the reference stops (the same tokens kept).
    Without a stop its text is one decode of all the ids, the provenance counts are the reference's, and with a
    byte-level tokenizer the pieces (text, provenance, spans) are too (a SentencePiece tokenizer's run of byte tokens
    is shown once the run is over: its text is not final before). With one, its text is the decode of the ids up to the round that completed the stop, cut before the stop
    that ends first (the reference decodes the kept ids again instead, which shows a U+FFFD when the stop begins
    inside a character split over tokens), and its pieces add up to that text."""
    import random

    from text_reference import ReferenceText

    from verispec.pipeline.provenance import ProvenanceText
    from verispec.pipeline.text import TextAssembler, byte_tokens

    rng = random.Random(seed)
    chunks = [rng.randint(1, 5) for _ in ids]
    accepted = [rng.randint(0, c - 1) for c in chunks]
    new = run_text(lambda: ProvenanceText(tok, stops), ids, chunks, accepted)
    old = run_text(lambda: ReferenceText(tok, stops), ids, chunks, accepted)
    assert new[0] == old[0], (ids, stops)
    keep, pieces, text, read = new
    decode = lambda part: tok.decode(part, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    if keep is None:
        assert text == old[2] == decode(ids), (ids, stops)
        if not byte_tokens(tok):  # byte-level BPE: the pieces themselves are the reference's
            assert pieces == old[1], (ids, stops)
        totals = [(sum(p[1] for p in run), sum(p[2] for p in run)) for run in (pieces, old[1])]
        assert totals[0] == totals[1] and sum(totals[0]) == len(ids)
    else:
        start = TextAssembler(tok, stops)._find_stop(decode(ids[:read]))[0]
        assert text == decode(ids[:read])[:start], (ids, stops)
    assert "".join(p[0] for p in pieces) == text == "".join(t for p in pieces for t, _ in p[3])


def stops_of(text: str, rng) -> list[list[str]]:
    """Stop string sets for a text: none, a substring found late, one at its very start, two overlapping ones, one
    inside a multi-byte character's neighbourhood (one character), one never found."""
    if len(text) < 4:
        return [[], [text[:1]]]
    i = rng.randrange(len(text) // 2, len(text) - 1)
    j = rng.randrange(1, len(text) - 2)
    wide = next((c for c in text if len(c.encode()) > 1), text[-1])
    return [[], [text[i : i + rng.randint(1, 6)]], [text[:2]], [text[j : j + 3], text[j + 1 : j + 5]], [wide],
            ["never-in-the-text"]]


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> character table of byte-level BPE: printable bytes as themselves, the rest from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return [table[b] for b in range(256)]


def byte_ids(tok, data: bytes) -> list[int]:
    """A byte-level tokenizer's ids of raw bytes (valid UTF-8 or not)."""
    alphabet = byte_alphabet()
    return tok.convert_tokens_to_ids([alphabet[b] for b in data])


INVALID = [b"ok \xff then", b"\xc3", b"cut \xe2\x28\xa1 here", b"emoji start \xf0\x9f\x98", b"\xe2\x82\xac\xe2\x82",
           b"a\xc3\xa9\xc3"]


@pytest.mark.parametrize("seed", range(3))
def test_incremental_text_equals_the_reference_on_a_byte_tokenizer(tok, seed):
    import random

    rng = random.Random(seed)
    cases = [(tok(text).input_ids, text) for text in UNICODE]
    cases += [(byte_ids(tok, data), data.decode(errors="replace")) for data in INVALID]
    for ids, text in cases:
        for stops in stops_of(text, rng):
            assert_same_text(tok, ids, stops, seed)


@pytest.mark.parametrize("seed", range(3))
def test_incremental_text_equals_the_reference_on_a_sentencepiece_tokenizer(seed):
    """Leading spaces dropped at the start of a decode, byte fallback for unseen characters (a byte token alone
    decodes to U+FFFD), invalid byte sequences."""
    import random

    from tiny import sentencepiece_tokenizer

    sp = sentencepiece_tokenizer()
    rng = random.Random(seed)
    byte = {b: sp.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    cases = [(sp(text, add_special_tokens=False).input_ids, text) for text in UNICODE]
    cases += [(sp("ok", add_special_tokens=False).input_ids + [byte[b] for b in data], data.decode(errors="replace"))
              for data in INVALID]
    for ids, text in cases:
        for stops in stops_of(text, rng):
            assert_same_text(sp, ids, stops, seed)


def test_a_special_token_inside_a_byte_run_leaves_the_run_whole():
    """A decode that skips special tokens drops them before the decoder joins byte tokens into text, so byte tokens
    on both sides of a special one are one run: 'A' then byte 0x82 is invalid UTF-8 as a whole (a U+FFFD per byte),
    and the three bytes of '€' split by one make '€'."""
    import random

    from tiny import sentencepiece_tokenizer

    sp = sentencepiece_tokenizer()
    byte = {b: sp.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    ok = sp("ok", add_special_tokens=False).input_ids
    for data, at in ((b"A\x82", 1), (b"\xe2\x82\xac", 1), (b"\xe2\x82\xac", 2), (b"AB", 1)):
        ids = ok + [byte[b] for b in data[:at]] + [sp.eos_token_id] + [byte[b] for b in data[at:]] + ok
        text = sp.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert text == sp.decode([i for i in ids if i != sp.eos_token_id], clean_up_tokenization_spaces=False)
        for seed in range(3):
            for stops in stops_of(text, random.Random(seed)):
                assert_same_text(sp, ids, stops, seed)


def test_a_stop_test_that_sees_fewer_ids_reads_again(tok):
    """The engine never shows the stop test fewer ids than before; if a caller does, it is read again from the
    start rather than answered from ids it no longer has."""
    ids = tok("one two STOP three").input_ids
    asm = TextAssembler(tok, stop=["STOP"])
    assert asm.stop_index(ids[:6]) is None
    assert asm.stop_index(ids[:3]) is None
    assert asm.stop_index(ids) == len(tok("one two STOP").input_ids)


def test_a_round_costs_what_its_tokens_cost(tok):
    """The text path decodes each id with a few ids before it: the ids a decode is given stay few however long the
    text (the reference decodes them all, every round)."""
    decoded = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tok.decode(ids, **kw)

    from verispec.pipeline.provenance import ProvenanceText

    text = ProvenanceText(Counting(), ["never"])
    ids = tok("héllo wörld 🙂 " * 200).input_ids
    generated = []
    for i in range(0, len(ids), 3):
        generated += ids[i : i + 3]
        text.stop_test(generated)
        text.push(ids[i : i + 3])
    text.finish()
    assert len(ids) > 3000 and max(decoded) <= 8 and len(decoded) <= 2 * len(ids) + 2


# -- the line rules of code completion (llama-server's n_indent and t_max_predict_ms) ---------------------------


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_indent_rule_cuts_before_the_first_line_indented_less(tok, chunk):
    from verispec.pipeline.text import INDENT

    text = "x = 1\n    y = 2\n\t\t\t\tw\n  z = 3\n    never\n"
    ids = tok(text).input_ids
    asm = TextAssembler(tok, min_indent=4)
    shown, keep = _stream_until_stop(asm, ids, chunk)
    assert "".join(shown) == asm.text == "x = 1\n    y = 2\n\t\t\t\tw\n  "  # the line's indent kept, as llama-server
    assert keep == len(tok("x = 1\n    y = 2\n\t\t\t\tw\n  z").input_ids) and asm.stopped_by == INDENT


def test_indent_rule_spares_the_first_line_and_counts_blank_lines(tok):
    for text, want in [("a\nb", "a\n"), ("a\n\nb", "a\n"), ("  a\n  b\n", "  a\n  b\n")]:
        asm = TextAssembler(tok, min_indent=2 if text.startswith("  ") else 1)
        _, keep = _stream_until_stop(asm, tok(text).input_ids, 1)
        assert asm.text == want, text
    asm = TextAssembler(tok, min_indent=8)
    assert asm.stop_index(tok("unindented first line").input_ids) is None


def test_newline_rule_ends_at_the_first_newline_after_the_deadline(tok):
    from verispec.pipeline.text import NEWLINE

    now = [0.0]
    asm = TextAssembler(tok, newline_after=1.0, clock=lambda: now[0])
    first, second = tok("a\nb").input_ids, tok("c\nd\ne").input_ids
    assert asm.stop_index(first) is None  # a newline before the deadline ends nothing
    asm.push(first)
    now[0] = 2.0
    keep = asm.stop_index(first + second)
    assert keep == len(first) + 2 and asm.stopped_by == NEWLINE  # through the newline, kept
    asm.push(second)
    assert asm.text == "a\nbc\n"


def test_rules_and_stop_strings_the_first_decided_wins(tok):
    text = "x\n  y STOP\nz\n"
    for stop, min_indent, want in [(["STOP"], 1, "x\n  y "), (["never"], 1, "x\n  y STOP\n"), (["x\n "], 3, "")]:
        asm = TextAssembler(tok, stop=stop, min_indent=min_indent)
        _stream_until_stop(asm, tok(text).input_ids, 2)
        assert asm.text == want, (stop, min_indent)


def test_json_string_texts_are_the_prompts_strings_escaped(tok):
    """A prompt's strings as a JSON string value holds them (newlines and quotes escaped, non-ASCII as it is); a
    string with nothing to escape is left out; chat messages give their string content and text parts."""
    import json

    code = 'def f(x):\n    return "héllo"'
    messages = [{"role": "system", "content": "plain"}, {"role": "user", "content": code},
                {"role": "user", "content": [{"type": "text", "text": "a\tb"}]}, {"role": "assistant", "content": None}]
    assert prompt_strings(messages) == ["plain", code, "a\tb"] and prompt_strings(code) == [code]
    texts = json_string_texts(tok, prompt_strings(messages))
    assert [tok.decode(t) for t in texts] == ['def f(x):\\n    return \\"héllo\\"', "a\\tb"]
    assert tok.decode(texts[0]) in json.dumps({"content": code}, ensure_ascii=False)
