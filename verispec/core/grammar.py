"""Structured output: a request's constraint (a JSON schema, any JSON object, a regex, a choice of strings, a Lark or
GBNF grammar), compiled by llguidance (docs/structured-output.md says why that engine) into a matcher that masks
the target's logits at every position a round verifies.

Exactness, as every engine defines it: the output follows the target's distribution masked by the grammar at each
position. A round walks each row's draft through the row's matcher (`GrammarRow.walk`): the mask at every verified
position (after the committed tokens and the drafts before it) goes onto the target's logits before any other
processing, so p is masked alike for acceptance, the residual and the bonus; the matcher then steps back and takes
what was committed (`commit`). A deterministic draft (q one-hot) is cut before its first token the grammar forbids:
that token would be rejected for sure, and the residual of a one-hot q on a token of p = 0 is p itself, so the cut
changes nothing. A sampled draft (q a distribution) keeps its forbidden token, rejected for sure, so that the next
token comes from the residual norm(max(0, p - q)) as it must; it is cut after it. Where the grammar forces the next
tokens (a key, punctuation), they are a draft of their own (`forced`), free and verified like any.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from verispec.core.draft import Draft

GRAMMAR_CACHE = 64  # compiled grammars kept (by constraint), each request matching on a copy of its own
MAX_SPEC_CHARS = 200_000  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024
# JSON as the models write it inline: one space after ',' and ':', no other whitespace, so the punctuation and the
# keys the schema fixes are forced tokens (drafted free); flexible whitespace lets a small model wander into blanks
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
GBNF_ROOT = re.compile(r"^\s*root\s*::=", re.MULTILINE)  # llama.cpp's GBNF names its start rule root


@dataclass(frozen=True)
class Constraint:
    """What a generation must match: `kind` one of KINDS, `spec` its text (the schema as JSON, the regex, the
    choices as a JSON list, the grammar in Lark or GBNF); made by the constructors below (ValueError: malformed)."""

    kind: str
    spec: str = ""

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | str) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ValueError("the JSON schema is not valid JSON") from None
        if not isinstance(schema, Mapping):
            raise ValueError("a JSON schema is a JSON object")
        return Constraint("json_schema", _bounded(json.dumps(schema), "JSON schema"))  # key order is the output's

    @staticmethod
    def json_object() -> Constraint:
        return Constraint("json_object")

    @property
    def is_json(self) -> bool:
        """Whether the answer is a JSON value (a schema's, or any object)."""
        return self.kind in ("json_schema", "json_object")

    @staticmethod
    def regex(pattern: str) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("a regex is a non-empty string")
        return Constraint("regex", _bounded(pattern, "regex"))

    @staticmethod
    def choice(options: Sequence[str]) -> Constraint:
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("a choice is a non-empty list of non-empty strings")
        if len(options) > MAX_CHOICES:
            raise ValueError(f"a choice has at most {MAX_CHOICES} options, got {len(options)}")
        return Constraint("choice", _bounded(json.dumps(list(options)), "choice"))

    @staticmethod
    def grammar(text: str) -> Constraint:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a grammar is a non-empty string (Lark, or GBNF with a root rule)")
        return Constraint("grammar", _bounded(text, "grammar"))

    @staticmethod
    def of(json_schema: Mapping[str, Any] | str | None = None, regex: str | None = None,
           choice: Sequence[str] | None = None, grammar: str | None = None) -> Constraint | None:
        """The one constraint given by name (None: none given; ValueError: more than one, or a malformed one)."""
        given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice),
                                                 ("grammar", grammar)) if value is not None}
        if len(given) > 1:
            raise ValueError(f"one constraint at a time: got {', '.join(given)}")
        if not given:
            return None
        (name, value), = given.items()
        return getattr(Constraint, name)(value)

    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import gbnf_to_lark

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(self.spec)))
        if self.kind == "grammar":
            text = gbnf_to_lark(self.spec) if GBNF_ROOT.search(self.spec) else self.spec
            return LLMatcher.grammar_from_lark(text)
        raise ValueError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")


def _bounded(text: str, what: str) -> str:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"the {what} has {len(text):,} characters; the limit is {MAX_SPEC_CHARS:,}")
    return text


class Grammars:
    """Compiles constraints against one tokenizer: the llguidance tokenizer is made on first use (`tokenizer`, a
    function: reading a vocabulary takes about a second), the last GRAMMAR_CACHE compiled grammars are kept, and each
    request matches on a copy of its grammar's matcher. Safe to call from another thread than the decode loop's."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._make_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles on its tokenizing thread, the decode loop copies

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    @property
    def end_ids(self) -> frozenset[int]:
        """The ids that end a grammar's output (the model's ends of generation): a constrained generation ends on
        them, also where the request ignores EOS."""
        return frozenset(self.tokenizer.eos_tokens)

    def compile(self, constraint: Constraint):
        """The constraint's compiled matcher, in its start state (ValueError naming what is wrong with it)."""
        from llguidance import LLMatcher

        with self._lock:
            matcher = self._compiled.get(constraint)
            if matcher is not None:
                self._compiled.move_to_end(constraint)
                return matcher
        what = constraint.kind.replace("_", " ")
        try:
            text = constraint.grammar_text()
        except ValueError as exc:
            raise ValueError(f"invalid {what}: {_first_line(str(exc))}") from None
        error = LLMatcher.validate_grammar(text, self.tokenizer)  # compiles it (off the decode loop, where called so)
        if error:
            raise ValueError(f"invalid {what}: {_first_line(error)}")
        matcher = LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {what}: {_first_line(matcher.get_error())}")
        with self._lock:
            self._compiled[constraint] = matcher
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return matcher

    def row(self, constraint: Constraint) -> GrammarRow:
        """A fresh matcher for one generation under `constraint`."""
        return GrammarRow(self.compile(constraint).deep_copy(), self.vocab_size, self.end_ids)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "rejected by the grammar engine"


def allowed(bitmask: np.ndarray, token: int) -> bool:
    """Whether a packed mask (int32 words, bit i of word w for token 32 w + i) allows `token`."""
    return bool((int(bitmask[token >> 5]) >> (token & 31)) & 1)


@dataclass(frozen=True)
class Walk:
    """A draft walked through a row's grammar: `keep` of its tokens verified, the masks of the keep + 1 verified
    positions ([keep + 1, words] int32, packed as llguidance packs them, on the host)."""

    keep: int
    masks: np.ndarray


class GrammarRow:
    """One generation's matcher: it holds the committed tokens' state between rounds. The grammar's output ends with
    one of `end_ids` (where it is complete, its mask allows only those), which ends the generation."""

    def __init__(self, matcher, vocab_size: int, end_ids: frozenset[int]) -> None:
        self.matcher, self.vocab_size, self.end_ids = matcher, vocab_size, end_ids
        self.words = (vocab_size + 31) // 32
        self.ended = False
        self._draft = 0  # tokens a draft model's steps consumed (see drafted)

    def _mask(self) -> np.ndarray:
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)[: self.words]

    def _anything(self) -> np.ndarray:
        """The mask of a position after an end id: never kept (the round stops before it), and a row of -inf only
        would be no distribution."""
        return np.full(self.words, -1, dtype=np.int32)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (none where it admits more than one continuation)."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def walk(self, tokens: list[int], sampled: bool) -> Walk:
        """The masks of a draft's verified positions, and how many of its tokens to verify: a deterministic draft
        up to its first token the grammar forbids, a `sampled` one up to and including it (see the module's
        docstring). The matcher ends where it began."""
        masks, consumed, ends = [self._mask()], 0, False
        for token in tokens:
            if not allowed(masks[-1], token):
                break
            if token in self.end_ids:  # the output's end: verified, and nothing after it
                ends = True
                break
            if not self.matcher.consume_token(token):
                break
            consumed += 1
            masks.append(self._mask())
        keep = consumed
        if ends:
            keep += 1
            masks.append(self._anything())
        elif consumed < len(tokens) and sampled:  # the forbidden token is verified (rejected: p = 0), nothing after
            keep += 1
            masks.append(masks[-1])  # the row after it is never read: a rejection ends the round before it
        if consumed:
            self.matcher.rollback(consumed)
        return Walk(keep, np.stack(masks))

    def draft_mask(self) -> np.ndarray:
        """The mask after the tokens drafted so far (`drafted`): a draft model masks its q by it."""
        return self._mask()[None].copy()  # its own buffer: the matcher's is read-only

    def drafted(self, token: int) -> bool:
        """A draft model drew `token` (its mask allowed it): the matcher goes past it until `end_draft`. False: the
        draft goes no further (the output's end, or a token the grammar refuses)."""
        if token in self.end_ids or not self.matcher.consume_token(token):
            return False
        self._draft += 1
        return True

    def end_draft(self) -> None:
        """Back to the committed tokens' state."""
        if self._draft:
            self.matcher.rollback(self._draft)
            self._draft = 0

    def commit(self, tokens: list[int]) -> None:
        """Advance past a round's committed tokens (each one its mask allowed), up to the grammar's end: a token
        after an end id follows a stop, and the round drops it."""
        for token in tokens:
            if self.ended or token in self.end_ids:
                self.ended = True
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused a committed token: {_first_line(self.matcher.get_error())}")


def walk_drafts(grammars: list[GrammarRow | None], drafts: list[Draft], tokens: list[list[int] | None],
                cut: bool = True) -> tuple[list[Draft], list[np.ndarray | None]]:
    """Each constrained row's draft (its `tokens` on the host) walked through its grammar (None: the row has none):
    the draft it verifies and the masks of its verified positions; an unconstrained row's draft as it is, with no
    mask. `cut`: as `GrammarRow.walk` says; else the drafts stay whole, for a pass already under way, and the masks
    run to each draft's end (the rows past a forbidden token repeat the last: never read, its rejection ends the
    round; past the output's end they allow anything: what follows a stop is dropped)."""
    out, masks = list(drafts), [None] * len(drafts)
    for i, (grammar, draft, ids) in enumerate(zip(grammars, drafts, tokens)):
        if grammar is None:
            continue
        walk = grammar.walk(ids, sampled=draft.probs is not None)
        masks[i] = walk.masks
        if not cut:
            masks[i] = np.concatenate([walk.masks, np.repeat(walk.masks[-1:], len(ids) + 1 - len(walk.masks), 0)])
        elif walk.keep < len(ids):
            out[i] = replace(draft, tokens=draft.tokens[: walk.keep],
                             probs=None if draft.probs is None else draft.probs[: walk.keep])
    return out, masks


def apply_masks(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """logits [n, V] with -inf where the packed masks [n, words] forbid a token (fp32, on logits' device). The bits are
    unpacked on the device: one host -> device copy of the packed words, no sync."""
    n, vocab = logits.shape
    words = torch.from_numpy(masks).to(logits.device, non_blocking=True)
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    keep = ((words.unsqueeze(-1) >> bits) & 1).reshape(n, -1)[:, :vocab].bool()
    return logits.float().masked_fill(~keep, float("-inf"))
