"""Suffix drafting (SuffixDecoding, Oliaro et al., arXiv 2411.04975): propose the most frequent continuation
of the sequence's longest matching suffix, counted over the current prompt + generated tokens and over the
outputs this proposer saw generated before. Zero model cost; strong on repetitive workloads (agent loops,
code edits, the same request asked again).

The structure is a trie of every substring of at most `max_depth` tokens, each node counting the
occurrences that pass through it: the counts give the frequency of each continuation of a context, which a
suffix automaton does not keep cheaply as the text grows. The trie is updated online, O(max_depth) per new
token, and never rebuilt within a generation. A path that only one occurrence takes is not spelt out node
by node: its last shared node has one lazy child that points into the text the occurrence came from, and is
expanded one node at a time when a second occurrence follows it. Nodes then grow with the repeated part of
the text, not with max_depth x its length (the path compression of a suffix tree, kept to its simplest).

Three tries are searched together, their counts added: one over this generation's sequence (built at
`start`, extended as tokens are committed), one over the other texts its request gives to copy from (the
prompt's strings as a JSON answer escapes them: Request.lookup_texts), one over a history of past generations'
outputs, each kept with the max_depth - 1 prompt tokens before it so that a repeated request matches from
its first round. The history keeps at most `history_tokens` tokens; the oldest outputs are evicted first
(their counts removed exactly), so its size stays bounded.

A draft follows, from the matched node, the child with the highest count (ties: the most recent
occurrence) while the estimated probability of the whole draft (the product of each chosen child's share of
its siblings' counts) stays at or above `min_prob`, for at most spec_factor x the match length tokens.
Drafts are deterministic, so the verifier treats q as one-hot on them (`probs=None`): exact for sampling
too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch

from verispec.core.draft import Draft
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.core.timing import device_tensor
from verispec.names.drafters import Source


class _Text:
    """An append-only token list that lazy trie nodes point into; `base` orders texts by age (stamps)."""

    __slots__ = ("ids", "base")

    def __init__(self, ids: list[int], base: int) -> None:
        self.ids, self.base = ids, base


class _Node:
    """A trie node: `count` occurrences pass through it, the latest at `stamp`. A lazy node (`text` set, one
    occurrence) has no children: its continuation is text.ids[pos:end]."""

    __slots__ = ("count", "stamp", "children", "text", "pos", "end")

    def __init__(self, stamp: int, text: _Text | None = None, pos: int = 0, end: int = 0) -> None:
        self.count, self.stamp, self.children = 1, stamp, None
        self.text, self.pos, self.end = text, pos, end


# A place in a trie: a node, or (text, pos, end) inside a lazy node's continuation.
Cursor = _Node | tuple[_Text, int, int]


def _as_cursor(node: _Node) -> Cursor:
    return node if node.text is None else (node.text, node.pos, node.end)


def _steps(cursor: Cursor | None) -> list[tuple[int, int, int]]:
    """(token, count, stamp) of each continuation one token past `cursor` (none past None)."""
    if cursor is None:
        return []
    if type(cursor) is tuple:
        text, pos, end = cursor
        return [(text.ids[pos], 1, text.base + pos)] if pos < end and pos < len(text.ids) else []
    if not cursor.children:
        return []
    return [(tok, child.count, child.stamp) for tok, child in cursor.children.items()]


def _follow(cursor: Cursor | None, token: int) -> Cursor | None:
    """The cursor one token further along `token`, or None when no occurrence continues with it."""
    if cursor is None:
        return None
    if type(cursor) is tuple:
        text, pos, end = cursor
        ok = pos < end and pos < len(text.ids) and text.ids[pos] == token
        return (text, pos + 1, end) if ok else None
    child = cursor.children.get(token) if cursor.children else None
    return None if child is None else _as_cursor(child)


class SuffixTrie:
    """Counts of every substring of at most `max_depth` tokens of the texts added."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0)
        self.root.count = 0

    def append(self, active: list[_Node], text: _Text, j: int) -> list[_Node]:
        """Count the occurrences ending at text.ids[j], the token just appended to `text`. `active`: the
        shared (non-lazy) nodes of the suffixes ending at j - 1, by length from 0 (the root); a suffix
        longer than these lies in its own lazy node. Returns the same list for the suffixes ending at j."""
        token, stamp, out = text.ids[j], text.base + j, [self.root]
        for depth, node in enumerate(active):
            child = node.children.get(token) if node.children else None
            if child is None:  # a new path, and so are all longer suffixes': each occurrence's own lazy node
                for d in range(depth, len(active)):
                    self._new_leaf(active[d], token, text, j, d)
                break
            if child.text is not None:  # a second occurrence: spell out one node of the first one's path
                self._expand(child)
            child.count += 1
            child.stamp = stamp
            if depth + 1 < self.max_depth:
                out.append(child)
        return out

    def _new_leaf(self, node: _Node, token: int, text: _Text, j: int, depth: int) -> None:
        if node.children is None:
            node.children = {}
        node.children[token] = _Node(text.base + j, text, j + 1, j - depth + self.max_depth)

    @staticmethod
    def _expand(node: _Node) -> None:
        text, pos, end = node.text, node.pos, node.end
        node.text, node.children = None, {}
        if pos < end and pos < len(text.ids):
            node.children[text.ids[pos]] = _Node(text.base + pos, text, pos + 1, end)

    def add(self, text: _Text) -> None:
        """Count every substring of a whole text."""
        active = [self.root]
        for j in range(len(text.ids)):
            active = self.append(active, text, j)

    def remove(self, text: _Text) -> None:
        """Uncount every substring of a text added before; paths no occurrence takes any more are dropped."""
        ids, depth = text.ids, self.max_depth
        for i in range(len(ids)):
            node = self.root
            for tok in ids[i : i + depth]:
                child = node.children[tok]
                child.count -= 1
                if child.count == 0:
                    del node.children[tok]
                    break
                node = child

    def continuations(self, context: Iterable[int]) -> dict[int, int]:
        """{token: count} of the tokens that followed `context` (for tests and inspection)."""
        cursor = self.root
        for tok in context:
            cursor = _follow(cursor, tok)
        return {tok: count for tok, count, _ in _steps(cursor)}

    def size(self) -> int:
        """Number of nodes (the root included)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += 1
            if node.children:
                stack.extend(node.children.values())
        return total


MAX_DEPTH = 24  # the longest substring counted: a match and its draft together
HISTORY_TOKENS = 65536  # the history's default token budget


class SuffixHistory:
    """Past outputs, counted in a trie and kept to a budget of `budget` tokens (the oldest evicted first, their
    counts removed exactly). The suffix lookups of a process's slots share one, so that every slot drafts from what
    any slot generated; `version` changes with every change, so that a lookup knows to find its cursors again.
    `new_text` stamps texts (the history's and the lookups' own) in the order they were made: a tie between
    continuations goes to the most recent."""

    def __init__(self, max_depth: int = MAX_DEPTH, budget: int = HISTORY_TOKENS) -> None:
        if budget < 0:
            raise ValueError(f"history_tokens must be >= 0, got {budget}")
        self.max_depth, self.budget = max_depth, budget
        self._made = 0
        self.clear()

    def clear(self) -> None:
        """Forget every past output."""
        self.trie = SuffixTrie(self.max_depth)
        self._texts: deque[_Text] = deque()
        self.tokens = 0  # tokens held
        self.version = getattr(self, "version", 0) + 1

    def new_text(self, ids: list[int]) -> _Text:
        self._made += 1
        return _Text(ids, self._made << 40)

    def add(self, ids: list[int]) -> None:
        """Count a finished text, evicting the oldest texts past the budget (a text longer than the budget keeps
        its last tokens)."""
        ids = ids[max(0, len(ids) - self.budget) :] if self.budget else []
        if not ids:
            return
        while self._texts and self.tokens + len(ids) > self.budget:
            old = self._texts.popleft()
            self.trie.remove(old)
            self.tokens -= len(old.ids)
        text = self.new_text(ids)
        self.trie.add(text)
        self._texts.append(text)
        self.tokens += len(ids)
        self.version += 1

    def continuations(self, context: Iterable[int]) -> dict[int, int]:
        """{token: count} of the tokens that followed `context` in the history."""
        return self.trie.continuations(context)


class SuffixProposer:
    """Suffix-tree drafting over this generation's sequence and a bounded history of past outputs.

    max_depth: the longest substring counted; a match and its draft together span at most this many tokens.
    spec_factor: a match of m tokens drafts at most spec_factor x m tokens (short matches, short drafts).
    min_prob: stop the draft once its estimated probability (the product of each chosen continuation's share
        of its context's counts) would fall below this.
    min_confident: matches of at least this many tokens are the source 'suffix', shorter ones
        'suffix-short' (a k policy learns them apart, as it does n-gram matches).
    history_tokens: the history's token budget (0: no history); the oldest outputs are evicted past it.
    history: a SuffixHistory to share with other lookups (None: one of its own, of history_tokens tokens).

    `reset()` forgets this generation (its index, and its output, which is then not added to the history);
    the history survives it, and `history.clear()` forgets that."""

    def __init__(
        self, max_depth: int = MAX_DEPTH, spec_factor: float = 1.0, min_prob: float = 0.1, min_confident: int = 3,
        history_tokens: int = HISTORY_TOKENS, history: SuffixHistory | None = None,
    ) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (a match and one drafted token), got {max_depth}")
        if spec_factor <= 0:
            raise ValueError(f"spec_factor must be > 0, got {spec_factor}")
        if not 0 <= min_prob <= 1:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        if min_confident < 1:
            raise ValueError(f"min_confident must be >= 1, got {min_confident}")
        if history is not None and history.max_depth != max_depth:
            raise ValueError(f"a shared history counts substrings of {history.max_depth} tokens, not {max_depth}")
        self.max_depth, self.spec_factor, self.min_prob = max_depth, spec_factor, min_prob
        self.min_confident = min_confident
        self.history = history if history is not None else SuffixHistory(max_depth, history_tokens)
        self.last_match = 0  # length of the last draft's match (0: none)
        self._seq: TokenSequence | None = None
        self.reset()

    def add_history(self, ids: list[int]) -> None:
        """Count a finished text in the history."""
        self.history.add(ids)

    def _record(self, seq: TokenSequence) -> None:
        """Add a finished generation's output to the history, with the prompt tokens just before it as its
        context (what a repeated request will match on)."""
        if len(seq) > seq.prompt_length:
            self.add_history(seq.ids[max(0, seq.prompt_length - self.max_depth + 1) :])

    # -- this generation's index ---------------------------------------------------------------------

    def start(self, seq: TokenSequence, params: SamplingParams, rng: torch.Generator,
              texts: Sequence[Sequence[int]] = ()) -> None:
        """Record the previous generation's output, count `texts` (see _set_texts), then index `seq`, reusing the
        index when seq extends the sequence it was built on, as the next turn of a chat does: that output is then
        counted in both tries, which only weighs it more in the ranking of continuations."""
        self.end()
        self._set_texts([list(t) for t in texts if len(t) > 1])
        text = self._text
        self._index(seq, len(seq) >= len(text.ids) and seq.ids[: len(text.ids)] == text.ids)

    def _set_texts(self, texts: list[list[int]]) -> None:
        """Count this generation's other texts in a trie of their own: only those past the last generation's when
        these begin with them (an agent's next turn adds a message), else anew. Stamped oldest, so that a tie between
        continuations goes to the sequence's or the history's."""
        if texts[: len(self._texts)] != self._texts:
            self._texts, self._texts_trie = [], SuffixTrie(self.max_depth)
        for ids in texts[len(self._texts) :]:
            self._texts_trie.add(_Text(ids, 0))
        self._texts = texts

    def _index(self, seq: TokenSequence, reuse: bool = False) -> None:
        """Point this generation's index at seq: extend the current one (reuse) or build a new one."""
        if not reuse:
            self._trie, self._text = SuffixTrie(self.max_depth), self.history.new_text([])
            self._active = [self._trie.root]
        self._seq = seq
        self._find_history(seq)
        self._sync(seq)

    def _find_history(self, seq: TokenSequence) -> None:
        """The cursors of the suffixes of seq, by length (up to max_depth - 1), in the history's and the texts'
        tries."""
        self._history_at = self._cursors(self.history.trie, seq.ids)
        self._texts_at = self._cursors(self._texts_trie, seq.ids)
        self._history_len, self._history_version = len(seq), self.history.version

    def _cursors(self, trie: SuffixTrie, ids: list[int]) -> list[Cursor]:
        at = [trie.root]
        for tok in ids[-(self.max_depth - 1) :]:
            at = self._advance(trie, at, tok)
        return at

    def _advance(self, trie: SuffixTrie, at: list[Cursor], token: int) -> list[Cursor]:
        """The cursors after `token`, from those of the suffixes before it."""
        out = [trie.root]
        for cursor in at[: self.max_depth - 1]:
            nxt = _follow(cursor, token)
            if nxt is None:
                break
            out.append(nxt)
        return out

    def _sync(self, seq: TokenSequence) -> None:
        """Count the tokens committed since the last call: O(max_depth) each. A different or truncated
        sequence is indexed afresh."""
        text, ids = self._text, seq.ids
        if seq is not self._seq or len(ids) < len(text.ids) or (text.ids and ids[len(text.ids) - 1] != text.ids[-1]):
            self._index(seq)
            return
        for j in range(len(text.ids), len(ids)):
            text.ids.append(ids[j])
            self._active = self._trie.append(self._active, text, j)
        if self._history_version != self.history.version:  # another lookup sharing the history changed it
            self._find_history(seq)
            return
        for tok in ids[self._history_len :]:
            self._history_at = self._advance(self.history.trie, self._history_at, tok)
            if self._texts:  # most requests have none: their cursors stay at the empty trie's root
                self._texts_at = self._advance(self._texts_trie, self._texts_at, tok)
        self._history_len = len(ids)

    # -- drafting ----------------------------------------------------------------------------------

    def _match(self, seq: TokenSequence, longest: int) -> tuple[int, list[Cursor]]:
        """(m, cursors): the longest suffix of seq, of at most `longest` tokens, that occurred before with a
        continuation, and its cursors in the three tries; (0, []) when none did."""
        self._sync(seq)
        tries = (self._active, self._history_at, self._texts_at)
        for m in range(min(max(map(len, tries)) - 1, longest), 0, -1):
            cursors = [c[m] for c in tries if m < len(c)]
            if any(_steps(c) for c in cursors):
                return m, cursors
        return 0, []

    def _walk(self, cursors: list[Cursor], limit: int) -> list[int]:
        """Up to `limit` tokens, each the most frequent continuation (ties: the most recent) of the match and
        the tokens chosen so far, while the draft's estimated probability stays >= min_prob."""
        tokens, prob = [], 1.0
        while len(tokens) < limit:
            tally: dict[int, tuple[int, int]] = {}
            for cursor in cursors:
                for tok, count, stamp in _steps(cursor):
                    c, s = tally.get(tok, (0, -1))
                    tally[tok] = (c + count, max(s, stamp))
            if not tally:
                break
            best = max(tally, key=tally.__getitem__)
            prob *= tally[best][0] / sum(c for c, _ in tally.values())
            if prob < self.min_prob:
                break
            tokens.append(best)
            cursors = [c for c in (_follow(c, best) for c in cursors) if c is not None]
        return tokens

    def source(self, seq: TokenSequence) -> str:
        """'suffix' (a match of at least min_confident tokens), 'suffix-short' (a shorter one) or 'none' (no
        match, or its best continuation is below min_prob)."""
        m, cursors = self._match(seq, self.max_depth - 1)
        if not m or not self._walk(cursors, 1):
            return Source.NONE
        return Source.SUFFIX if m >= self.min_confident else Source.SUFFIX_SHORT

    def propose(self, seq: TokenSequence, k: int) -> Draft:
        """The longest match that leaves room in max_depth for k tokens (any shorter suffix of a match is a
        match too), then the walk from it."""
        source = self.source(seq)
        m, cursors = self._match(seq, max(1, self.max_depth - k))
        self.last_match = m
        limit = min(k, max(1, int(self.spec_factor * m)), self.max_depth - m)
        tokens = self._walk(cursors, limit) if m else []
        return Draft(device_tensor(tokens, seq.buffer.device), None, source)

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        pass  # the committed tokens are counted when the next round asks

    def end(self) -> None:
        """Add the generation's output (as its sequence holds it now) to the history."""
        if self._seq is not None:
            self._record(self._seq)
            self._seq = None

    def reset(self) -> None:
        self.last_match = 0
        self._seq = None
        self._trie = SuffixTrie(self.max_depth)
        self._texts: list[list[int]] = []  # the other texts _texts_trie counts
        self._texts_trie = SuffixTrie(self.max_depth)
        self._text = self.history.new_text([])
        self._active: list[_Node] = [self._trie.root]
        self._history_at: list[Cursor] = [self.history.trie.root]
        self._texts_at: list[Cursor] = [self._texts_trie.root]
        self._history_len, self._history_version = 0, self.history.version
