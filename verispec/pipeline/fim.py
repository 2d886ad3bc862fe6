"""Fill-in-the-middle prompts: the layout a code model was trained with, found in its tokenizer.

A FIM prompt asks for the text between a prefix and a suffix. Code models learn it with special tokens
(Qwen2.5-Coder: `<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>`, the middle follows), and
repository context with two more (`<|repo_name|>` name, then `<|file_sep|>` path, newline, text per file).
`FimLayout.of(tokenizer)` finds those tokens by the names the code-model families give them (the names
llama.cpp's vocabulary loader looks for); `FimLayout.encode` lays a prefix, suffix and other files out as
llama-server's /infill does, so that an editor gets the same prompt from verispec as from llama-server:

    [REPO]myproject\\n [SEP]name0\\n text0 [SEP]name1\\n text1 ... [SEP]filename\\n [PRE]prefix+prompt [SUF]suffix [MID]

(without repository and file tokens, each file's text follows a "--- snippet ---" line instead; without other
files, the prompt starts at [PRE] unless the repository header is asked for, as /infill does). The caller's
text is tokenised with special tokens read as plain text, each part on its own, as llama.cpp does: code that
contains "<|fim_prefix|>" is text, not a marker. `Budget` bounds each part in tokens (the prefix keeps its end,
the suffix its start, the files their end), as llama-server fits its prompt into a batch.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

# the names each marker goes by, per family (llama.cpp's src/llama-vocab.cpp looks for the same)
PREFIX_NAMES = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>")
SUFFIX_NAMES = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>")
MIDDLE_NAMES = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>")
REPO_NAMES = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FILE_SEP_NAMES = ("<|file_sep|>",)

PROJECT = "myproject"  # the repository name llama-server writes after the repository token
CURRENT_FILE = "filename"  # and the name of the file being edited
DEFAULT_FILE = "tmp"  # the name of another file given without one
SNIPPET = "\n\n--- snippet ---\n\n"  # a file's header where the model has no file separator


def _find(vocab: Mapping[str, int], names: Sequence[str]) -> int | None:
    return next((vocab[name] for name in names if name in vocab), None)


@dataclass(frozen=True)
class Budget:
    """The most tokens each part of a FIM prompt keeps (None: all): the prefix its last `prefix` tokens (the
    request's `prompt` text after it counts apart), the suffix its first `suffix`, the other files their last
    `files` tokens."""

    prefix: int | None = None
    suffix: int | None = None
    files: int | None = None

    @classmethod
    def llama_server(cls, n_prompt: int, files: int | None, n_batch: int = 2048) -> Budget:
        """llama-server's budget at its default batch of 2048 tokens: 3/4 of a batch for the prefix, the rest less
        the prompt's `n_prompt` tokens and two markers for the suffix (`files`: what the context leaves)."""
        return cls(3 * (n_batch // 4), max(0, n_batch // 4 - (2 + n_prompt)), files)


@dataclass(frozen=True)
class FimLayout:
    """A model's fill-in-the-middle markers (token ids); `repo` and `file_sep` are None where the model has no
    repository-level markers; `bos` the ids its tokenizer starts a text with (none for Qwen)."""

    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None
    bos: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer) -> FimLayout | None:
        """The layout of this tokenizer's model (found once per tokenizer), or None when it lacks a prefix, suffix
        or middle marker."""
        try:
            return _LAYOUTS[tokenizer]
        except (KeyError, TypeError):
            pass
        layout = cls._find(tokenizer)
        try:
            _LAYOUTS[tokenizer] = layout
        except TypeError:  # a tokenizer that takes no weak reference: found again next time
            pass
        return layout

    @classmethod
    def _find(cls, tokenizer) -> FimLayout | None:
        vocab = tokenizer.get_vocab()
        prefix, suffix, middle = (_find(vocab, names) for names in (PREFIX_NAMES, SUFFIX_NAMES, MIDDLE_NAMES))
        if prefix is None or suffix is None or middle is None:
            return None
        plain = list(tokenizer("a", add_special_tokens=False).input_ids)
        with_specials = list(tokenizer("a").input_ids)
        bos = tuple(with_specials[: len(with_specials) - len(plain)]) if with_specials[-len(plain):] == plain else ()
        return cls(prefix, suffix, middle, _find(vocab, REPO_NAMES), _find(vocab, FILE_SEP_NAMES), bos)

    def encode(self, tokenizer, prefix: str, suffix: str, files: Iterable[tuple[str, str]] = (), prompt: str = "",
               budget: Budget = Budget(), header: bool | None = None) -> list[int]:
        """The prompt ids asking for the middle between `prefix` (+ `prompt`, text typed after it) and `suffix`,
        with `files` ((name, text) pairs: the repository's other files) before it. `header`: the repository's and
        the current file's names around the files, where the model has markers for them (None: where files are
        given; llama-server's /infill always writes them)."""
        files = list(files)
        header = bool(files) if header is None else header
        ids = functools.partial(text_ids, tokenizer)

        context: list[int] = []
        if header and self.repo is not None:
            context += [self.repo, *ids(PROJECT + "\n")]
        for name, text in files:
            context += [self.file_sep, *ids(name + "\n")] if self.file_sep is not None else ids(SNIPPET)
            context += ids(text)
        if header and self.file_sep is not None:
            context += [self.file_sep, *ids(CURRENT_FILE + "\n")]
        before, after, typed = ids(prefix), ids(suffix), ids(prompt)
        before = before[len(before) - min(len(before), _limit(budget.prefix, len(before))):]
        after = after[: _limit(budget.suffix, len(after))]
        context = context[len(context) - min(len(context), _limit(budget.files, len(context))):]
        return [*context, *self.bos, self.prefix, *before, *typed, self.suffix, *after, self.middle]

    def fitted(self, tokenizer, prefix: str, suffix: str, files: Iterable[tuple[str, str]], prompt: str,
               limit: int) -> list[int]:
        """The prompt as llama-server's /infill builds it (the header always written): the prefix's last 1536
        tokens, the suffix's first 510 less the typed prompt's, and of the other files' (and the header's) last
        tokens as many as keep the whole within `limit` tokens (llama-server: what its slot's context leaves)."""
        budget = Budget.llama_server(len(text_ids(tokenizer, prompt)), None)
        core = len(self.encode(tokenizer, prefix, suffix, (), prompt, budget, header=False))
        return self.encode(tokenizer, prefix, suffix, files, prompt, replace(budget, files=max(0, limit - core)),
                           header=True)


def text_ids(tokenizer, text: str) -> list[int]:
    """The ids of a part of a FIM prompt: its text alone, special tokens' text read as text."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids) if text else []


def layout_of(tokenizer) -> FimLayout:
    """The tokenizer's FimLayout, or a ValueError saying the model has none (NO_FIM)."""
    layout = FimLayout.of(tokenizer)
    if layout is None:
        raise ValueError(NO_FIM)
    return layout


def _limit(bound: int | None, size: int) -> int:
    return size if bound is None else min(size, bound)


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its FimLayout (or None)


def file_pairs(files: Mapping[str, str] | Iterable[tuple[str, str] | Mapping[str, str]]) -> list[tuple[str, str]]:
    """Other files as (name, text) pairs, from a mapping name -> text, pairs, or {"filename", "text"} dicts
    (llama-server's input_extra; a missing name is DEFAULT_FILE). TypeError: anything else."""
    items = files.items() if isinstance(files, Mapping) else files
    pairs = []
    for item in items:
        if isinstance(item, Mapping):
            name, text = item.get("filename", DEFAULT_FILE), item.get("text")
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            name, text = item
        else:
            raise TypeError("files are a mapping name -> text, (name, text) pairs or {'filename', 'text'} dicts")
        if not isinstance(name, str) or not isinstance(text, str):
            raise TypeError("a file's name and text are strings")
        pairs.append((name, text))
    return pairs


NO_FIM = ("this model's tokenizer has no fill-in-the-middle tokens (a prefix, suffix and middle marker, e.g. "
          "Qwen2.5-Coder's <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>): use a code model trained for infilling")


__all__ = ["Budget", "FimLayout", "NO_FIM", "file_pairs", "layout_of", "text_ids"]
