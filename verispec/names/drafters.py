"""The names of drafters, of the sources their drafts come from, and of the options a spec takes.

A drafter (`--drafter`) is how drafts are made; a draft's source says where one round's draft came from, so that a
k policy can learn each source's acceptance and cost apart (an n-gram drafter's long and short matches, a hybrid's
lookup and model drafts)."""

from __future__ import annotations

from enum import StrEnum


class Source(StrEnum):
    """Where a round's draft came from (equal to its string, which reports and JSON carry)."""

    MODEL = "model"  # a draft language model
    NGRAM = "ngram"  # prompt lookup, a match of at least min_confident tokens
    NGRAM_SHORT = "ngram-short"  # prompt lookup, a shorter match
    SUFFIX = "suffix"  # suffix-tree lookup, a match of at least min_confident tokens
    SUFFIX_SHORT = "suffix-short"  # suffix-tree lookup, a shorter match
    TREE = "tree"  # a token tree from a draft LM: a plan's k is its node budget, its depth the draft forwards
    GUESS = "guess"  # a k policy's own one-token guess, verified to learn a pass's cost
    GRAMMAR = "grammar"  # the tokens a request's grammar forces next (structured output)
    NONE = "none"  # the drafter has no draft this round


# the sources that run a draft model: a request's first round does not draft from them (its first token would wait
# for the draft's prefill and steps); they draft from the second round on
DRAFT_MODEL_SOURCES = frozenset({Source.MODEL, Source.TREE})

DRAFTER_NAMES = ("model", "ngram", "suffix", "hybrid", "hybrid-suffix", "tree")  # assembly's registry has these
FREE_DRAFTERS = ("ngram", "suffix")  # the drafters that take no draft model

BACKEND_NAMES = {"hf": "transformers", "llamacpp": "llama.cpp"}  # backend -> its name in messages
DEVICES = ("auto", "cpu", "cuda")
DRAFT_FORWARDS = ("auto", "lean", "transformers")
QUANT_MODES = ("none", "int8", "int4")  # a transformers draft's weight-only quantisation
