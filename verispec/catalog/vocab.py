"""What two tokenizers' vocabularies have in common: each token's bytes, and the tokens both hold.

A draft of another tokenizer drafts over the tokens whose strings both vocabularies hold (verispec.proposers
.cross_vocab). Tokens are compared by the bytes they stand for, so that two byte-level BPE vocabularies, or a
byte-level and a SentencePiece one, meet on the same text; a special or added token (EOS, chat markers) stands for
its own content and matches only a special or added token of the other vocabulary. Works on `tokenizers.Tokenizer`
objects (a transformers fast tokenizer's `backend_tokenizer`); torch-free, so that `verispec models list` can say
what a pair shares without loading a model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

SMALL_SHARE = 0.5  # below this share of the draft's tokens in common, a pair warns that drafting may not help
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte fallback tokens


@cache
def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet as a str.translate table, character -> the Latin-1 character of its byte:
    printable bytes stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[256 + extra] = chr(b)
            extra += 1
    return table


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes each id of a `tokenizers.Tokenizer` stands for (b"" for an id the vocabulary skips). Byte-level
    BPE tokens are decoded through its alphabet; other tokens are text with SentencePiece's '▁' for a space and
    <0xNN> for a byte; special and added tokens are their content."""
    from tokenizers import decoders

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    alphabet = _byte_level_alphabet()
    for token, i in vocab.items():
        if i in added:
            table[i] = added[i].encode()
        elif byte_level and max(latin := token.translate(alphabet), default="") <= "\xff":
            table[i] = latin.encode("latin-1")
        elif (m := _BYTE_TOKEN.match(token)) is not None:
            table[i] = bytes([int(m.group(1), 16)])
        else:
            table[i] = token.replace("▁", " ").encode()
    return table


def byte_tokens(table: list[bytes]) -> dict[int, int]:
    """byte -> the lowest id of a token that is that one byte (byte-level BPE and byte-fallback vocabularies hold
    all 256)."""
    found: dict[int, int] = {}
    for i in range(len(table) - 1, -1, -1):
        if len(table[i]) == 1:
            found[table[i][0]] = i
    return found


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of a `tokenizers.Tokenizer`'s special and added tokens."""
    return frozenset(tokenizer.get_added_tokens_decoder())


@dataclass(frozen=True)
class SharedTokens:
    """The tokens two vocabularies both hold: `pairs` (target id, draft id), one per shared string, and the sizes
    they are shares of."""

    pairs: tuple[tuple[int, int], ...]
    target_size: int
    draft_size: int

    @property
    def draft_share(self) -> float:
        """The share of the draft's tokens the target also holds: what the draft can still propose."""
        return len(self.pairs) / max(1, self.draft_size)

    def describe(self) -> str:
        return (f"{len(self.pairs):,} tokens in common ({self.draft_share:.0%} of the draft's {self.draft_size:,}, "
                f"{len(self.pairs) / max(1, self.target_size):.0%} of the target's {self.target_size:,})")

    def warning(self) -> str | None:
        """A one-line warning when too few of the draft's tokens are shared for drafting to help (None: enough)."""
        if self.draft_share >= SMALL_SHARE:
            return None
        return (f"the draft and the target share only {self.draft_share:.0%} of the draft's tokens: drafts may "
                f"rarely be accepted")


def shared_tokens(target, draft) -> SharedTokens:
    """The tokens a target's and a draft's `tokenizers.Tokenizer` both hold, matched by bytes (special tokens only
    with special tokens), in target id order; a string held by several ids of one vocabulary pairs through one of
    them (see _preferred_order)."""
    t_bytes, d_bytes = token_bytes(target), token_bytes(draft)
    t_special, d_special = special_ids(target), special_ids(draft)
    index: dict[tuple[bool, bytes], int] = {}
    for i in reversed(_preferred_order(draft, len(d_bytes))):
        if d_bytes[i]:
            index[(i in d_special, d_bytes[i])] = i
    pairs, seen = [], set()
    for i in _preferred_order(target, len(t_bytes)):
        key = (i in t_special, t_bytes[i])
        if t_bytes[i] and key in index and key not in seen:
            seen.add(key)
            pairs.append((i, index[key]))
    return SharedTokens(tuple(sorted(pairs)), sum(1 for b in t_bytes if b), sum(1 for b in d_bytes if b))


def _preferred_order(tokenizer, size: int) -> list[int]:
    """Ids in the order a string held by several of them pairs: the lowest first, a SentencePiece byte token
    (<0xNN>) after every other (it stands for the byte only where no piece holds it, so a model rarely predicts it
    where a piece would do)."""
    fallback = {i for t, i in tokenizer.get_vocab(with_added_tokens=True).items() if _BYTE_TOKEN.match(t)}
    return sorted(range(size), key=lambda i: (i in fallback, i))


def without_prefix_space(tokenizer):
    """A copy of a `tokenizers.Tokenizer` that encodes a piece of running text as it stands: no space prepended
    (SentencePiece's Prepend normaliser or Metaspace prepend_scheme, a byte-level add_prefix_space), so that text
    continuing a word does not become a new word."""
    import json

    from tokenizers import Tokenizer

    def strip(node):
        if isinstance(node, dict):
            if node.get("type") == "Sequence" and "normalizers" in node:
                node["normalizers"] = [n for n in node["normalizers"] if n.get("type") != "Prepend"]
            if "prepend_scheme" in node:
                node["prepend_scheme"] = "never"
            if "add_prefix_space" in node:
                node["add_prefix_space"] = False
            for value in node.values():
                strip(value)
        elif isinstance(node, list):
            for value in node:
                strip(value)

    spec = json.loads(tokenizer.to_str())
    if isinstance(spec.get("normalizer"), dict) and spec["normalizer"].get("type") == "Prepend":
        spec["normalizer"] = None
    strip(spec)
    return Tokenizer.from_str(json.dumps(spec))


@cache
def _tokenizer_file(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def installed_tokens(name: str) -> SharedTokens | None:
    """What an installed known model's tokenizer shares with the default target's (None: either is not installed,
    or they are the same tokenizer)."""
    from verispec.catalog.disk import TOKENIZER_DIR, installed
    from verispec.catalog.known_models import DEFAULT_TARGET

    paths = [installed(n) for n in (DEFAULT_TARGET, name)]
    files = [p / TOKENIZER_DIR / "tokenizer.json" for p in paths if p is not None]
    if len(files) < 2 or not all(f.is_file() for f in files) or files[0].read_bytes() == files[1].read_bytes():
        return None
    target, draft = (_tokenizer_file(str(f)) for f in files)
    if target.get_vocab(with_added_tokens=True) == draft.get_vocab(with_added_tokens=True):
        return None
    return shared_tokens(target, draft)
