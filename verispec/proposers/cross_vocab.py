"""A draft model of another tokenizer drafting for the target, exactly, in every round of every slot.

The two models meet on text. Each slot keeps its committed sequence as bytes and the draft's tokens spelling them
(the target's new tokens are appended as bytes each round and the new text is encoded with the draft's tokenizer;
the draft's cache keeps the tokens that still spell the text, so a round costs the new text, not the whole
sequence). A row drafts one of two ways:

- shared (sampled rows only): the draft's distribution restricted to the tokens both vocabularies hold
  (verispec.catalog.vocab), mapped to target ids and processed like the target's (temperature, top-k/p, the
  penalties over the target's tokens): q, exact in target ids, so that the ordinary rejection sampler keeps the
  output distributed as the target's. The draft feeds itself the draft id of each token it drew.
- text: the draft decodes k tokens of its own (its whole vocabulary, argmax), their text is encoded with the
  target's tokenizer and the first k target tokens are the draft, one-hot (a deterministic function of the
  context, so exact under any verification, greedy or sampled). This reads the draft tokens on the host once per
  round.

Greedy rows draft by text. Sampled rows draft the way WayChoice picks: which is accepted more depends on the pair,
the text and the temperature (a peaked target accepts the draft's argmax often; where the tokenizers split text
alike and the target is flat, the shared-token distribution wins).

A row whose committed text ends inside a character the draft's tokens cannot yet spell, or whose draft-side
sequence would not fit the draft's context, drafts nothing that round.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from verispec.backends.base import Model, common_prefix_length
from verispec.backends.vocab import VocabBridge
from verispec.core.draft import Draft
from verispec.core.grammar import GrammarRow
from verispec.core.rows import penalty_state
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.core.timing import device_tensor
from verispec.names.drafters import Source
from verispec.proposers.base import DraftRow
from verispec.proposers.draft_model import after_token, draft_step, draft_token
from verispec.proposers.lookup import no_draft

FEED_MAX = 4  # draft-side tokens a first draft step feeds at most; more are caught up in a pass of their own
SAMPLED_WAYS = ("auto", "shared", "text")  # how sampled rows draft (see WayChoice)
EXPLORE = 0.5  # a request's worse way still drafts EXPLORE * sqrt(rounds) of its sampled rounds


def text_pieces(data: bytes) -> tuple[list[str | int], int]:
    """`data` as runs of text and single bytes that are no UTF-8 (ints), up to its last complete character, and
    how many bytes that is (an incomplete character at the end waits for its next bytes)."""
    pieces: list[str | int] = []
    at = 0
    while at < len(data):
        try:
            pieces.append(data[at:].decode())
            return pieces, len(data)
        except UnicodeDecodeError as exc:
            if exc.start:
                pieces.append(data[at : at + exc.start].decode())
            if exc.reason == "unexpected end of data":
                return pieces, at + exc.start
            pieces += data[at + exc.start : at + exc.end]
            at += exc.end
    return pieces, at


def encode_bytes(data: bytes, encode, single: dict[int, int]) -> tuple[list[int], int]:
    """Token ids for `data`: its text through `encode`, a byte that is no UTF-8 as the vocabulary's token for that
    byte (`single`); stops before an incomplete last character or a byte the vocabulary has no token for. Returns
    the ids and how many bytes they cover."""
    pieces, covered = text_pieces(data)
    ids, at = [], 0
    for piece in pieces:
        if isinstance(piece, str):
            ids += encode(piece)
            at += len(piece.encode())
        elif piece in single:
            ids.append(single[piece])
            at += 1
        else:
            return ids, at
    return ids, covered


def sampled_way(way: str) -> str:
    """`way` when it names a way sampled rows draft (SAMPLED_WAYS), else ValueError."""
    if way not in SAMPLED_WAYS:
        raise ValueError(f"unknown way of drafting sampled rows '{way}' (use {', '.join(SAMPLED_WAYS)})")
    return way


class WayChoice:
    """Which way one request's sampled rounds draft: 'shared' or 'text' (see the module docstring), or, for
    'auto', the way whose draft tokens the target has accepted at the higher rate so far (accepted over accepted
    plus rejected, with one of each assumed at the start), trying the other way whenever it has drafted fewer than
    EXPLORE * sqrt(rounds) rounds: the worse way keeps being measured, ever more rarely. The choice depends only
    on the request's own rounds already verified: each round's q is the distribution its tokens came from (the
    output stays exact), and a seeded request drafts, hence samples, alike whatever its batch mates."""

    def __init__(self, way: str = "auto") -> None:
        self.way = sampled_way(way)
        self.accepted = {"text": 1, "shared": 1}
        self.rejected = {"text": 1, "shared": 1}
        self.count = {"text": 0, "shared": 0}
        self.rounds = 0

    def rate(self, way: str) -> float:
        return self.accepted[way] / (self.accepted[way] + self.rejected[way])

    def pick(self) -> str:
        """The way the next sampled round drafts."""
        if self.way != "auto":
            return self.way
        self.rounds += 1
        best = max(self.count, key=self.rate)
        other = "shared" if best == "text" else "text"
        return other if self.count[other] < EXPLORE * math.sqrt(self.rounds) else best

    def record(self, way: str, drafted: int, accepted: int) -> None:
        """A verified sampled round of `way`: `accepted` of its `drafted` tokens were accepted (a round that drafted
        nothing, as by text when k draft tokens end inside a character, counts as a rejection)."""
        self.count[way] += 1
        self.accepted[way] += accepted
        self.rejected[way] += drafted == 0 or accepted < drafted


@dataclass
class Spelling:
    """One slot's draft-side view of its committed sequence: the target tokens seen so far as `text` (bytes), and
    draft tokens `ids` with the byte offset after each (`ends`). ids[:checked] spell text[:ends[checked - 1]]; a
    round's drafts follow them until the next sync checks them against the committed text."""

    seq: TokenSequence | None = None
    seen: int = 0  # tokens of seq in text
    text: bytearray = field(default_factory=bytearray)
    ids: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    checked: int = 0
    base: int = 0  # len(ids) when the round's drafts started
    seq_base: int = 0  # len(seq) then
    # the round's draft tokens (draft ids): by text, all of them from propose; over the shared tokens, [] until
    # observe gives the accepted ones; None: no round in flight
    drafted: list[int] | None = None
    by_text: bool = False  # the round in flight drafts by text (else over the shared tokens)
    ways: WayChoice = field(default_factory=WayChoice)
    params: SamplingParams = field(default_factory=SamplingParams)
    rng: torch.Generator | None = None

    @property
    def spelled(self) -> int:
        """Bytes of text the checked draft tokens spell."""
        return self.ends[self.checked - 1] if self.checked else 0


class CrossVocabDraft:
    """Drafts with `model` (a Model of as many slots as the round's target, in the draft's own vocabulary) for a
    target of another vocabulary, through `bridge` (verispec.backends.vocab.VocabBridge). Follows the Drafter
    protocol (verispec.proposers.base) like DraftModel; see the module docstring for what it drafts. `sampled`:
    how sampled rows draft, a name in SAMPLED_WAYS (see WayChoice)."""

    def __init__(self, model: Model, bridge: VocabBridge, sampled: str = "auto") -> None:
        self.model = model
        self.bridge = bridge
        self.sampled = sampled_way(sampled)
        self.vocab_size = bridge.target_vocab
        self._slots = [Spelling() for _ in range(model.slots)]

    # -- the draft side of the committed text ----------------------------------------------------------

    def _spell(self, data: bytes, at: int) -> tuple[list[int], list[int]]:
        """Draft tokens for `data` (a slot's text from byte `at`) up to where they can spell it, and the byte
        offset after each. Tokens that do not spell their text byte for byte (a SentencePiece space) end where the
        text they stand for ends."""
        ids: list[int] = []
        ends: list[int] = []
        table = self.bridge.draft_bytes
        pieces, _ = text_pieces(data)
        for piece in pieces:
            if isinstance(piece, int):
                if piece not in self.bridge.draft_byte_ids:
                    break
                ids.append(self.bridge.draft_byte_ids[piece])
                at += 1
                ends.append(at)
                continue
            enc = self.bridge.encode_draft(piece, start=at == 0)
            size = len(piece.encode())
            run = list(accumulate((len(table[i]) for i in enc.ids), initial=at))[1:]
            if run and run[-1] != at + size:
                prefix = list(accumulate((len(c.encode()) for c in piece), initial=0))
                run = [at + prefix[end] for _, end in enc.offsets]
                run[-1] = at + size
            ids += enc.ids
            ends += run
            at += size
        return ids, ends

    def _close_round(self, s: Spelling, slot: int) -> None:
        """A round's drafts end up in ids: a round by text all (the cache was fed all but the last), a round over
        the shared tokens only those committed (the cache is cut to them)."""
        if s.drafted is None:
            return
        if s.drafted:
            table = self.bridge.draft_bytes
            at = s.ends[s.base - 1] if s.base else 0
            s.ids[s.base :] = s.drafted
            s.ends[s.base :] = list(accumulate((len(table[i]) for i in s.drafted), initial=at))[1:]
        else:
            s.ids[s.base :], s.ends[s.base :] = [], []
        s.drafted = None
        self.model.rollback(slot, min(self.model.lengths[slot], len(s.ids)))

    def _sync(self, slot: int, seq: TokenSequence) -> bool:
        """Bring the slot's draft tokens up to its committed sequence: new target tokens become text, drafts that
        still spell it are kept (and checked), the rest of the text is encoded (from one token back, so that it
        may merge with what follows), and the draft's cache is rolled back to the tokens it still shares. True
        when the draft tokens spell the whole text (the slot may draft)."""
        s = self._slots[slot]
        self._close_round(s, slot)
        target_bytes = self.bridge.target_bytes
        for t in seq.ids[s.seen :]:
            s.text += target_bytes[t]
        s.seen = len(seq)
        draft_bytes, j = self.bridge.draft_bytes, s.checked
        while j < len(s.ids):
            start = s.ends[j - 1] if j else 0
            token = draft_bytes[s.ids[j]]
            if not token or s.ends[j] > len(s.text) or s.text[start : s.ends[j]] != token:
                break
            j += 1
        s.checked = j
        if s.spelled < len(s.text):
            j = s.checked = max(0, j - 1)
            ids, ends = self._spell(bytes(s.text[s.spelled :]), s.spelled)
        else:
            ids, ends = [], []
        old, cached = s.ids, self.model.lengths[slot]
        s.ids, s.ends = old[:j] + ids, s.ends[:j] + ends
        s.checked = len(s.ids)
        keep = min(cached, j + common_prefix_length(old[j:cached], s.ids[j:]), max(0, len(s.ids) - 1))
        if keep < cached:
            self.model.rollback(slot, keep)
        return bool(s.ids) and s.spelled == len(s.text)

    # -- the Drafter protocol ------------------------------------------------------------------------

    def start(self, slot: int, seq: TokenSequence, params: SamplingParams, rng: torch.Generator,
              grammar: GrammarRow | None = None, texts: Sequence[Sequence[int]] = ()) -> None:
        """Keep the draft tokens spelling the text this sequence shares with the slot's last; the rest is encoded
        and fed lazily."""
        s = self._slots[slot]
        self._close_round(s, slot)
        held = s.seq.ids[: s.seen] if s.seq is not None else []
        shared = min(common_prefix_length(held, seq.ids), len(seq) - 1)
        target_bytes = self.bridge.target_bytes
        nbytes = sum(len(target_bytes[t]) for t in seq.ids[:shared])
        keep = bisect_right(s.ends, nbytes, hi=s.checked)
        del s.ids[keep:], s.ends[keep:], s.text[nbytes:]
        s.seq, s.seen, s.checked, s.params, s.rng = seq, shared, keep, params, rng
        s.ways = WayChoice(self.sampled)
        self.model.rollback(slot, min(self.model.lengths[slot], keep))

    def _fits(self, slot: int, k: int = 1) -> bool:
        """Whether the slot's draft tokens and k drafts fit the draft's context (its tokens count the text apart
        from the target's: past its context the draft stops drafting)."""
        return len(self._slots[slot].ids) + k <= self.model.max_length

    def source(self, slot: int, seq: TokenSequence) -> str:
        return Source.MODEL if self._fits(slot) else Source.NONE

    def pending(self, slot: int, seq: TokenSequence) -> int:
        """Draft tokens to feed in a separate catch-up pass before the next propose (0 when its first draft step
        feeds them: at most FEED_MAX)."""
        if not self._sync(slot, seq) or not self._fits(slot):
            return 0
        behind = len(self._slots[slot].ids) - self.model.lengths[slot]
        return behind - 1 if behind > FEED_MAX else 0

    def catch_up(self, slot: int, seq: TokenSequence, limit: int | None = None) -> int:
        """Feed up to `limit` draft tokens of the committed text the cache has not seen, in one pass of this slot
        alone, always leaving the last one for the first draft step."""
        if not self._sync(slot, seq) or not self._fits(slot):
            return 0
        ids, at = self._slots[slot].ids, self.model.lengths[slot]
        n = len(ids) - 1 - at
        if limit is not None:
            n = min(n, limit)
        if n <= 0:
            return 0
        self.model.forward_rows([slot], [device_tensor(ids[at : at + n], self.model.device)], logits_for=[0])
        return n

    def propose(self, rows: list[DraftRow]) -> list[Draft]:
        drafts = [no_draft(seq) for _, seq, _, _ in rows]
        live, feeds, state = [], {}, {}
        for i, (slot, seq, k, _) in enumerate(rows):
            if k <= 0 or not self._sync(slot, seq):
                continue
            s = self._slots[slot]
            if not self._fits(slot, k):
                continue
            live.append(i)
            feeds[i] = device_tensor(s.ids[self.model.lengths[slot] :], self.model.device)
            s.base, s.seq_base, s.drafted = len(s.ids), len(seq), []
            s.by_text = s.params.greedy or s.ways.pick() == "text"
            state[i] = (*((None, None) if s.by_text else penalty_state(seq, s.params, self.vocab_size)), [], [])
        rounds = dict.fromkeys(live, 0)
        step = 0
        while live:
            logits = draft_step(self.model, [rows[i][0] for i in live], [feeds[i] for i in live])
            for i, row_logits in zip(live, logits):
                slot, seq, _, _ = rows[i]
                s = self._slots[slot]
                presence, counts, tokens, probs = state[i]
                if s.by_text:  # the draft's own next token, among those with text
                    token = row_logits.masked_fill(~self.bridge.draft_speaks, float("-inf")).argmax(dim=-1)  # [1]
                    feeds[i] = token
                else:
                    token, q = draft_token(self.bridge.to_target(row_logits), s.params, presence, counts,
                                           seq.new_tokens + step, s.rng)  # [1] target id, q [1, V]
                    presence, counts = after_token(presence, counts, token)
                    probs.append(q)
                    feeds[i] = self.bridge.to_draft(token)
                tokens.append(token)
                state[i] = (presence, counts, tokens, probs)
                rounds[i] += 1
            step += 1
            live = [i for i in live if rows[i][2] > step]
        text_rows = [i for i in rounds if self._slots[rows[i][0]].by_text]
        if text_rows:  # the one host read of the draft tokens of the rows drafting by text
            drawn = torch.cat([torch.cat(state[i][2]) for i in text_rows]).tolist()
        for i, steps in rounds.items():
            slot, seq, k, _ = rows[i]
            s, tokens, probs = self._slots[slot], state[i][2], state[i][3]
            if i in text_rows:
                s.drafted, drawn = drawn[: len(tokens)], drawn[len(tokens) :]
                target = self._retokenize(s.drafted)[:k]  # none: the draft's forwards are still counted
                drafts[i] = Draft(device_tensor(target, seq.buffer.device), None, Source.MODEL, steps)
            else:
                drafts[i] = Draft(torch.cat(tokens), torch.cat(probs), Source.MODEL, steps)
        return drafts

    def _retokenize(self, drafted: list[int]) -> list[int]:
        """The target's tokens for the bytes of the draft's tokens (up to its last complete character)."""
        table = self.bridge.draft_bytes
        data = b"".join(table[i] for i in drafted)
        return encode_bytes(data, self.bridge.encode_target, self.bridge.target_byte_ids)[0]

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        """A round over the shared tokens: its accepted drafts' draft ids join the draft tokens (a round by text
        joined its draft tokens at propose; the next sync checks them against the text). Every sampled round
        tells the request's way choice how many of its drafts were accepted."""
        s = self._slots[slot]
        if s.drafted is not None and not s.params.greedy:
            s.ways.record("text" if s.by_text else "shared", drafted, accepted)
        if s.drafted is not None and not s.by_text:
            s.drafted = [self.bridge.draft_of[t] for t in seq.ids[s.seq_base : s.seq_base + accepted]]
        self._close_round(s, slot)

    def swap(self, a: int, b: int) -> None:
        self.model.swap(a, b)
        self._slots[a], self._slots[b] = self._slots[b], self._slots[a]

    def release(self, slot: int) -> None:
        pass  # the cache stays: the slot's next sequence keeps what it shares with this one

    def reset(self) -> None:
        self.model.reset()
        self._slots = [Spelling() for _ in range(self.model.slots)]
