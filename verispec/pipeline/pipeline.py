"""A built pipeline: the engine with its tokenizer and the specs it was built from, generating text.

`Pipeline.generate` and `Pipeline.stream` take a prompt as text, chat messages or token ids, and sampling
settings as keywords or a transformers GenerationConfig; they apply stop strings at the text level and
feed a transformers streamer when given one. Pipelines are made by verispec.assembly.build (`build`, `load`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from verispec.backends.base import Model
from verispec.backends.vocab import VocabBridge
from verispec.core.grammar import Constraint
from verispec.core.sampling import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.request import Committed, Request
from verispec.decoding.stats import SpecStats
from verispec.names.errors import SpecError
from verispec.names.options import MAX_NEW_TOKENS, sampling_from
from verispec.pipeline.completion import Completion
from verispec.pipeline.fim import Budget, FimLayout, file_pairs, layout_of
from verispec.pipeline.provenance import Piece
from verispec.pipeline.slots import Slot, Slots, drain
from verispec.pipeline.text import encode_messages, json_string_texts, prompt_strings

# prompt: text, chat messages ({"role", "content"} dicts), token ids, or a [n] / [1, n] tensor of them
Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int] | torch.Tensor


class TextStream:
    """Iterate to get text pieces as rounds commit them, or iterate `pieces()` to get them as `Piece`s, which
    also say how many of their tokens were drafted-and-accepted and how many the target produced (and the
    text per token); the piece counts over a stream add up to the result's token count and accepted count.
    `rounds()` gives each round's committed tokens with the piece they completed. `result` holds the
    Completion so far (final once iteration ended); `finished` says whether generation ran to its end.
    The request runs in a slot of the pipeline's engine (verispec.pipeline.slots, as a server's requests do),
    taken when iteration starts. Closing the stream early (a client went away) leaves the pipeline consistent.
    A transformers streamer, when given, gets the prompt ids first (as transformers' generate does: a streamer
    made with skip_prompt=True skips them), then each round's committed ids, and `end()` when generation ends,
    also when it ends by an error or an early close."""

    def __init__(self, slots: Slots, request: Request, streamer=None) -> None:
        self._slots, self._request, self._streamer = slots, request, streamer
        self._slot: Slot | None = None  # once iteration started
        self._with_text = True
        self._events: Iterator[tuple[Committed, Piece | None]] | None = None
        self._texts: Iterator[str] | None = None
        self.finished = False

    def _run(self) -> Iterator[tuple[Committed, Piece | None]]:
        slots, streamer, with_text = self._slots, self._streamer, self._with_text
        try:
            if streamer is not None:
                streamer.put(torch.tensor([list(self._request.prompt_ids)]))  # [1, n], as transformers' generate
            slot = self._slot = slots.add(self._request)
            while not slot.done:
                try:
                    chunks = slots.step()
                except BaseException:  # a round that raised (e.g. KeyboardInterrupt mid-pass): no cache is trusted
                    slots.abort()
                    raise
                for _, chunk in chunks:
                    if streamer is not None:
                        streamer.put(torch.tensor(chunk))  # [m] newly committed ids
                    yield chunk, slot.push(chunk) if with_text else None
            self.finished = True
            rest = slot.text.finish() if with_text else None
            if rest is not None:
                yield Committed([], 0), rest
        except BaseException:  # closed, or failed, between rounds (a streamer, the text): the caches are consistent
            if self._slot is not None:
                slots.cancel(self._slot)
            raise
        finally:
            if with_text and self._slot is not None:
                self._slot.text.finish()
            if streamer is not None:
                streamer.end()

    def _started(self) -> Iterator[tuple[Committed, Piece | None]]:
        if self._events is None:
            self._events = self._run()
        return self._events

    def rounds(self, text: bool = True) -> Iterator[tuple[Committed, Piece | None]]:
        """Each round's committed tokens and the text piece they completed (None: none yet), then, when text
        was held back to the end, (no tokens, the rest). `text=False`: no text at all (no detokenising: for
        timing the decoding alone); to be asked before the stream is iterated."""
        if not text:
            if self._events is not None:
                raise RuntimeError("rounds(text=False) must come before the stream is iterated")
            self._with_text = False
        return self._started()

    def pieces(self) -> Iterator[Piece]:
        """The same stream as Pieces (text, accepted, target, spans); the last may have no text (tokens
        whose text is empty or cut by a stop string). Iterate one of this, `rounds()` or the stream."""
        return (piece for _, piece in self._started() if piece is not None)

    def __iter__(self) -> Iterator[str]:
        if self._texts is None:
            self._texts = (piece.text for _, piece in self._started() if piece is not None and piece.text)
        return self._texts

    def __next__(self) -> str:
        return next(iter(self))

    def close(self) -> None:
        """Stop generating (the committed tokens stay in `result`)."""
        self._started().close()

    @property
    def result(self) -> Completion:
        slot = self._slot
        if slot is None:  # not started: nothing generated yet
            return Completion("", [], "length", SpecStats(prompt_tokens=len(self._request.prompt_ids)))
        text = slot.text if self._with_text else None
        return Completion.of(text.text if text else "", slot.result, text.stop_reason if text else None)


def _is_prompt_list(prompt: Any) -> bool:
    """A list of prompts (texts, message lists, token-id lists), not one prompt (text, messages, ids)."""
    if isinstance(prompt, (str, torch.Tensor, Mapping)) or not isinstance(prompt, Sequence) or not prompt:
        return False
    return all(isinstance(p, (str, torch.Tensor)) or (isinstance(p, Sequence) and not isinstance(p, Mapping))
               for p in prompt)


def sampling_settings(generation_config=None, **explicit: Any) -> tuple[SamplingParams, int]:
    """(SamplingParams, max_new_tokens) from a transformers GenerationConfig overlaid with the keyword arguments
    that are not None, which win (verispec.names.options.sampling_from). Unset everywhere: greedy,
    MAX_NEW_TOKENS."""
    max_new_tokens = explicit.pop("max_new_tokens", None)
    if max_new_tokens is None and generation_config is not None:
        max_new_tokens = getattr(generation_config, "max_new_tokens", None)
    params = sampling_from(explicit, generation_config)
    return params, MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens


class TargetView(Protocol):
    """What a pipeline reads of the target spec it was built from (verispec.assembly's TargetSpec)."""

    backend: str
    dtype: str | None

    @property
    def label(self) -> str: ...


class DraftView(Protocol):
    """What a pipeline reads of the draft spec it was built from (verispec.assembly's DraftSpec)."""

    drafter: str
    backend: str
    quant: str

    @property
    def label(self) -> str | None: ...


@dataclass(frozen=True, eq=False)
class Pipeline:
    """A target, its drafter and k, ready to generate. `engine` decodes (token ids in and out: SpeculativeEngine);
    `target` and `draft` are the resolved specs it was built from (`draft` None: plain decoding);
    `draft_model` the draft LM, if any; `draft_forward` how a transformers draft runs (lean, transformers;
    none otherwise); `load_seconds` what loading took, per part; `reason` why the target runs on its backend
    (and, where they were defaults, where the drafter and k came from), one line; `kernels` which llama.cpp
    kernels verify and why, one line (None: no model runs on llama.cpp); `batch_reason` why the pipeline cannot
    decode a batch (None: it can, with `make_batch(max_batch)`); `vocab_bridge` how a draft model of another
    tokenizer meets the target (None: the draft shares the target's)."""

    engine: SpeculativeEngine
    tokenizer: Any
    target: TargetView
    draft: DraftView | None
    device: torch.device
    draft_model: Model | None = None
    draft_forward: str = "none"
    load_seconds: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""
    kernels: str | None = None
    batch_reason: str | None = "batched decoding needs a pipeline made by verispec.assembly.build"
    make_batch: Callable[[int], SpeculativeEngine] | None = None
    vocab_bridge: VocabBridge | None = None
    _batches: dict[int, SpeculativeEngine] = field(default_factory=dict, init=False, repr=False)  # by size

    # -- what was built ---------------------------------------------------------------------------

    @property
    def target_ref(self) -> str:
        """The target's reference, as text."""
        return self.target.label

    @property
    def backend(self) -> str:
        """The target's backend."""
        return self.target.backend

    @property
    def drafter(self) -> str:
        """The drafter's name, or 'none' (plain decoding)."""
        return "none" if self.draft is None else self.draft.drafter

    @property
    def draft_ref(self) -> str | None:
        """The draft model's reference, as text (None: no draft model)."""
        return self.draft.label if self.draft is not None else None

    @property
    def draft_backend(self) -> str | None:
        """The draft model's backend (None: no draft model)."""
        return None if self.draft_model is None else self.draft.backend

    @property
    def dtype(self) -> str | None:
        """The dtype of the models verispec loaded through transformers (bf16, fp16, fp32; None: there are
        none, e.g. both on llama.cpp, or the target was passed loaded and keeps its own)."""
        return self.target.dtype if "hf" in (self.backend, self.draft_backend) else None

    @property
    def k(self) -> int | str:
        """Draft tokens per round: an integer (0: plain decoding) or 'auto'."""
        return self.engine.k

    def setup(self) -> dict[str, object]:
        """What runs and why, for front ends to show: backend, drafter, k, dtype, the reason, the llama.cpp
        kernels, and what a draft of another tokenizer shares with the target (None: the same tokenizer)."""
        shared = None if self.vocab_bridge is None else self.vocab_bridge.shared.describe()
        return {"backend": self.backend, "drafter": self.drafter, "k": self.k, "dtype": self.dtype,
                "reason": self.reason, "kernels": self.kernels, "shared_vocab": shared}

    @property
    def draft_quant(self) -> str:
        """The draft model's weight quantisation ('none' also when there is no draft model)."""
        return "none" if self.draft_model is None else self.draft.quant

    @property
    def context_length(self) -> int:
        """Tokens the pair can hold: the target's context, or the draft model's when that is shorter and counts the
        same tokens (a draft of another tokenizer stops drafting where its context ends)."""
        n_ctx = self.engine.target.max_length
        if self.draft_model is None or self.vocab_bridge is not None:
            return n_ctx
        return min(n_ctx, self.draft_model.max_length)

    # -- generating -------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt: text is tokenised as is, chat messages through the tokenizer's chat
        template (with the assistant's turn opened), token ids are taken as they are."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            if prompt.dim() != 1:
                raise ValueError(f"one prompt at a time: expected token ids of shape [n] or [1, n], got "
                                 f"{list(prompt.shape)}")
            return [int(t) for t in prompt.tolist()]
        items = list(prompt)
        if items and all(isinstance(m, Mapping) for m in items):
            return encode_messages(self.tokenizer, items)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return items
        raise TypeError("a prompt is text, a list of chat messages ({'role', 'content'} dicts) or token ids")

    @property
    def fim(self) -> FimLayout | None:
        """The target's fill-in-the-middle layout (verispec.pipeline.fim; None: its tokenizer has no FIM markers)."""
        return FimLayout.of(self.tokenizer)

    def encode_infill(self, prefix: str, suffix: str, files: Any = (), prompt: str = "", budget: Budget = Budget(),
                      header: bool | None = None) -> list[int]:
        """Token ids of a fill-in-the-middle prompt: the middle between `prefix` (then `prompt`, text typed after
        it) and `suffix`, with the repository's other `files` before it (a mapping name -> text, or (name, text)
        pairs), laid out as the model was trained to read them (verispec.pipeline.fim; `header`: the repository's
        and the file's names, as FimLayout.encode). ValueError: the model has no FIM markers; TypeError: a part
        that is not text."""
        if not all(isinstance(part, str) for part in (prefix, suffix, prompt)):
            raise TypeError("a fill-in-the-middle prompt's prefix, suffix and prompt are text")
        return layout_of(self.tokenizer).encode(self.tokenizer, prefix, suffix, file_pairs(files), prompt, budget,
                                                header)

    def request(self, prompt: Prompt, *, suffix: str | None = None, files: Any = (), max_new_tokens: int | None = None,
                stop: Sequence[str] | str = (), k: int | str | None = None, generation_config=None,
                json_schema: Mapping[str, Any] | str | None = None, regex: str | None = None,
                choice: Sequence[str] | None = None, grammar: str | None = None, **sampling: Any) -> Request:
        """The Request for a prompt and these settings. `suffix`: fill in the middle between the prompt (text) and
        this suffix, with the repository's other `files` before them (see `encode_infill`). `sampling`:
        SamplingParams' options by name (None: unset; verispec.names.options declares them); they win over
        `generation_config` (a transformers GenerationConfig), which wins over greedy decoding and max_new_tokens
        MAX_NEW_TOKENS. `stop`: strings that end generation (the text is cut before them). `k`: this
        generation's draft tokens per round (None: the pipeline's). Structured output, one of: `json_schema` (a dict
        or its JSON text; {"type": "object"} for any JSON object), `regex`, `choice` (the answer is one of these
        strings), `grammar` (Lark as llguidance reads it, or llama.cpp's GBNF): every token is drawn from the
        target's distribution masked by it (verispec.core.grammar)."""
        params, max_new = sampling_settings(generation_config, max_new_tokens=max_new_tokens, **sampling)
        if suffix is None and files:
            raise ValueError("files are the context of a fill-in-the-middle prompt: give a suffix too")
        ids = self.encode(prompt) if suffix is None else self.encode_infill(prompt, suffix, files)
        constraint = Constraint.of(json_schema=json_schema, regex=regex, choice=choice, grammar=grammar)
        json_answer = constraint is not None and constraint.is_json  # token ids hold no strings: none then
        texts = json_string_texts(self.tokenizer, prompt_strings(prompt)) if json_answer else ()
        return Request(prompt_ids=ids, params=params, max_new_tokens=max_new, k=k, stop=stop,
                       constraint=constraint, lookup_texts=texts)

    def stream(self, prompt: Prompt | Request, *, streamer=None, **settings: Any) -> TextStream:
        """Generate, yielding text pieces as they are committed (see TextStream; `.pieces()` for provenance):
        a Request, or a prompt and the settings of `request`. The request is checked here (ValueError), before
        the first round. `streamer`: a transformers TextStreamer / TextIteratorStreamer (or anything with
        put(ids tensor) and end())."""
        if isinstance(prompt, Request):
            if settings:
                raise TypeError("a Request comes alone: its settings are set on it")
            request = prompt
        else:
            request = self.request(prompt, **settings)
        slots = self.slots()
        slots.check(request)
        return TextStream(slots, request, streamer)

    def generate(self, prompt: Prompt | list[Prompt], **kwargs: Any) -> Completion | list[Completion]:
        """Generate to the end and return the Completion; takes the same arguments as `stream`. A list of
        prompts (texts, message lists or token-id lists) returns one Completion per prompt, in order: decoded
        together in batches (see `generate_batch`) where the pipeline can batch, else one after another."""
        if _is_prompt_list(prompt):
            return self.generate_batch(prompt, **kwargs)
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def batch(self, max_batch: int) -> SpeculativeEngine:
        """The engine of `max_batch` slots over this pipeline's models (the same weights, caches of its own, the
        same k policy), made on first use and kept (its caches are a llama.cpp context or a padded KV cache); one
        user at a time, like the pipeline. SpecError (runtime) when the pipeline cannot batch."""
        _check_max_batch(max_batch)
        if self.make_batch is None:
            raise SpecError(self.batch_reason or "this pipeline cannot batch", "max_batch", runtime=True)
        if max_batch not in self._batches:
            self._batches[max_batch] = self.make_batch(max_batch)
        return self._batches[max_batch]

    def slots(self, max_batch: int = 1) -> Slots:
        """Slots for a serving loop (verispec.pipeline.slots): `max_batch` requests decoding together where the
        pipeline can batch and more than one is asked for, else one at a time on the pipeline's own engine (`size`
        says which)."""
        _check_max_batch(max_batch)
        if max_batch > 1 and self.batch_reason is None:
            return Slots(self.batch(max_batch), self.tokenizer)
        return Slots(self.engine, self.tokenizer)

    def generate_batch(self, prompts: Sequence[Prompt], *, max_batch: int = 8, stop: Sequence[str] | str = (),
                       k: int | str | None = None, generation_config=None, **settings: Any) -> list[Completion]:
        """One Completion per prompt, at most `max_batch` sequences decoding together (continuous batching:
        a finished sequence's slot takes the next prompt at once). Sampling keywords as `stream`; each
        sequence gets its own RNG (seed: the same seed for each). One at a time where the pipeline
        cannot batch (`batch_reason`). Every prompt is checked before any is generated (ValueError)."""
        requests = [self.request(p, stop=stop, k=k, generation_config=generation_config, **settings)
                    for p in prompts]
        slots = self.slots(min(max_batch, len(prompts)) or 1)
        for request in requests:  # a bad prompt fails before any is generated
            slots.check(request)
        return drain(slots, requests)


def _check_max_batch(max_batch: int) -> None:
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise SpecError(f"max_batch must be an integer >= 1, got {max_batch!r}", "max_batch")


__all__ = ["Completion", "DraftView", "Piece", "Pipeline", "Prompt", "Request", "TargetView", "TextStream", "sampling_settings"]
