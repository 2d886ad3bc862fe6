"""Fill-in-the-middle prompts: the markers found in a tokenizer, the layout llama-server's /infill builds, the
budgets, and the library's infill requests on a tiny pair (greedy identity with every drafter)."""

from __future__ import annotations

import pytest
from tiny import FIM_TOKENS, byte_tokenizer, fim_tokenizer, perturbed, sentencepiece_tokenizer, tiny_qwen2

import verispec
from verispec.pipeline.fim import Budget, FimLayout, file_pairs

PRE, SUF, MID, REPO, SEP = 259, 260, 261, 262, 263


@pytest.fixture(scope="module")
def tok():
    return fim_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def test_markers_found_by_their_names(tok):
    assert FimLayout.of(tok) == FimLayout(PRE, SUF, MID, REPO, SEP)
    assert FimLayout.of(byte_tokenizer()) is None  # no markers
    assert FimLayout.of(sentencepiece_tokenizer()) is None
    # StarCoder's names, no file separator; the tokenizer's BOS starts the text
    star = fim_tokenizer(("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>"))
    star.add_special_tokens({"bos_token": "<s>"})
    star._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", star.convert_tokens_to_ids("<s>"))])
    layout = FimLayout.of(star)
    assert (layout.prefix, layout.suffix, layout.middle, layout.repo, layout.file_sep) == (259, 260, 261, 262, None)
    assert layout.bos == (star.convert_tokens_to_ids("<s>"),)
    # a middle marker missing: no layout
    assert FimLayout.of(fim_tokenizer(("<|fim_prefix|>", "<|fim_suffix|>"))) is None


def test_layout_is_llama_servers(tok):
    """[REPO]myproject\\n [SEP]name\\n text ... [SEP]filename\\n [PRE]prefix+prompt [SUF]suffix [MID]
    (llama.cpp's format_prompt_infill), each part tokenised on its own."""
    layout = FimLayout.of(tok)
    got = layout.encode(tok, "def f(x):\n    ", "\n    return y\n", [("a.py", "A = 1\n"), ("b.py", "B = 2\n")], "y = ")
    want = ([REPO, *ids(tok, "myproject\n"), SEP, *ids(tok, "a.py\n"), *ids(tok, "A = 1\n"), SEP,
             *ids(tok, "b.py\n"), *ids(tok, "B = 2\n"), SEP, *ids(tok, "filename\n"), PRE,
             *ids(tok, "def f(x):\n    "), *ids(tok, "y = "), SUF, *ids(tok, "\n    return y\n"), MID])
    assert got == want
    # no repository markers: files follow a snippet line, and no header is written
    bare = FimLayout(PRE, SUF, MID)
    assert bare.encode(tok, "p", "s", [("a.py", "A")]) == [*ids(tok, "\n\n--- snippet ---\n\n"), *ids(tok, "A"), PRE,
                                                           *ids(tok, "p"), SUF, *ids(tok, "s"), MID]
    assert bare.encode(tok, "", "") == [PRE, SUF, MID]
    # without files the header is written only when asked for (llama-server's /infill always asks)
    assert layout.encode(tok, "p", "s") == [PRE, *ids(tok, "p"), SUF, *ids(tok, "s"), MID]
    assert layout.encode(tok, "p", "s", header=True) == [REPO, *ids(tok, "myproject\n"), SEP, *ids(tok, "filename\n"),
                                                         PRE, *ids(tok, "p"), SUF, *ids(tok, "s"), MID]


def test_markers_in_the_text_are_text(tok):
    layout = FimLayout.of(tok)
    text = "x = '<|fim_middle|><|file_sep|>'"
    prompt = layout.encode(tok, text, text, [("<|fim_suffix|>", text)])
    assert prompt.count(MID) == 1 and prompt.count(SUF) == 1 and prompt.count(PRE) == 1
    assert prompt.count(SEP) == 2  # the file's and the current file's, none from the text
    assert tok.decode(prompt[prompt.index(PRE) + 1 : prompt.index(SUF)]) == text


def test_budget_keeps_the_prefix_end_the_suffix_start_and_the_last_files(tok):
    layout = FimLayout(PRE, SUF, MID, REPO, SEP)
    prefix, suffix = "abcdefgh", "12345678"
    files = [("a", "AAAA"), ("b", "BBBB")]
    whole = layout.encode(tok, prefix, suffix, files)
    cut = layout.encode(tok, prefix, suffix, files, budget=Budget(prefix=3, suffix=2, files=5))
    context = whole[: whole.index(PRE)]
    assert cut == [*context[-5:], PRE, *ids(tok, "fgh"), SUF, *ids(tok, "12"), MID]
    assert layout.encode(tok, prefix, suffix, budget=Budget(0, 0, 0)) == [PRE, SUF, MID]
    # llama-server's: 3/4 of 2048 for the prefix; the suffix gets the rest less the prompt and two markers
    assert Budget.llama_server(n_prompt=10, files=100) == Budget(1536, 500, 100)
    assert Budget.llama_server(n_prompt=600, files=None).suffix == 0


def test_file_pairs_forms():
    assert file_pairs({"a.py": "A", "b.py": "B"}) == [("a.py", "A"), ("b.py", "B")]
    assert file_pairs([("a.py", "A")]) == [("a.py", "A")]
    assert file_pairs([{"filename": "a.py", "text": "A"}, {"text": "B"}]) == [("a.py", "A"), ("tmp", "B")]
    for bad in ([{"filename": "a.py"}], ["text"], [("a", 1)]):
        with pytest.raises(TypeError):
            file_pairs(bad)


# -- the library: fill-in-the-middle requests on a tiny pair ------------------------------------------------


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen2(21, vocab_size=264, init=0.1)
    return target, perturbed(target, seed=22, noise=0.1)


PREFIX, SUFFIX = "def add(a, b):\n    total = a + b\n", "\n    return total\n\nprint(add(1, 2))\n"
FILES = {"util.py": "def add(a, b):\n    return a + b\n"}


@pytest.mark.parametrize("drafter", ["model", "ngram", "suffix", None])
def test_infill_is_plain_decoding_of_the_fim_prompt(models, tok, drafter):
    target, draft = models
    pipe = verispec.load(target, draft if drafter == "model" else None, tokenizer=tok, drafter=drafter, k=3)
    prompt = FimLayout.of(tok).encode(tok, PREFIX, SUFFIX, file_pairs(FILES))
    out = pipe.generate(PREFIX, suffix=SUFFIX, files=FILES, max_new_tokens=24)
    plain = verispec.load(target, tokenizer=tok, drafter=None).generate(prompt, max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.text == plain.text
    assert pipe.request(PREFIX, suffix=SUFFIX, files=FILES).prompt_ids == tuple(prompt)


def test_infill_refused_without_markers_or_text(models, tok):
    target, _ = models
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        verispec.load(target, tokenizer=byte_tokenizer(), drafter=None).generate("x", suffix="y")
    pipe = verispec.load(target, tokenizer=tok, drafter=None)
    with pytest.raises(TypeError, match="text"):
        pipe.generate([1, 2, 3], suffix="y")
    with pytest.raises(ValueError, match="suffix"):
        pipe.generate("x", files=FILES)


def test_fim_tokens_fixture_matches():
    assert fim_tokenizer().convert_tokens_to_ids(list(FIM_TOKENS)) == [PRE, SUF, MID, REPO, SEP]
