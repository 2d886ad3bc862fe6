"""A generation request, and what it resolves to before the first round.

`Request` is what a caller asks for, in one frozen value that travels from the front end (server, CLI, chat,
pipeline) to the engine or the batch; `resolve` checks it once (ValueError with a one-line reason) and fills
in what the model decides (the context's limit, EOS, the default k), so a request means the same alone and in
a batch. The engine knows token ids only: text stop strings ride in the request for the text layer
(verispec.pipeline), which hands the engine a `StopFn` for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from verispec.core.grammar import Constraint
from verispec.core.rows import TokenLogprob
from verispec.core.sampling import SamplingParams
from verispec.decoding.stats import SpecStats
from verispec.names.k import check_k
from verispec.names.options import MAX_NEW_TOKENS

# stop(generated ids) -> how many generated tokens to keep when a stop string was completed, else None
StopFn = Callable[[list[int]], "int | None"]



@dataclass(frozen=True, kw_only=True)
class Request:
    """One generation. `k`: its draft length (None: the engine's); `stop`: text stop
    strings (the text layer applies them, and its two line rules for code completion: `min_indent` > 0, a line
    after the first indented less ends generation before its first character; `newline_after` seconds after the
    first token, the next newline ends it, kept); `stop_token_ids` end generation like EOS does; `ignore_eos`:
    EOS does not; min_tokens (in params) masks whichever ids end it; `logprobs` n >= 0: each token's logprob and
    the n most likely alternatives under the target's processed distribution (None: not computed);
    `constraint`: what the output must match (a JSON schema, a regex, a choice, a grammar: verispec.core.grammar);
    `lookup_texts`: token texts besides the prompt that a lookup drafter (suffix, n-gram) may copy from, as the
    answer would write them (the prompt's strings escaped inside a JSON answer's strings:
    verispec.pipeline.text.json_string_texts); they change drafts only, never tokens."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = MAX_NEW_TOKENS
    k: int | str | None = None
    stop: tuple[str, ...] = ()
    min_indent: int = 0
    newline_after: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    constraint: Constraint | None = None
    lookup_texts: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "stop_token_ids"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))
        object.__setattr__(self, "lookup_texts", tuple(tuple(int(t) for t in text) for text in self.lookup_texts))
        stop = self.stop
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop))


def as_request(request: Request | Iterable[int], params: SamplingParams | None = None, **fields) -> Request:
    """`request` itself, or a Request of these prompt ids, params and fields (Request's keywords)."""
    if isinstance(request, Request):
        if params is not None or fields:
            raise TypeError("a Request comes alone: its fields are set on it")
        return request
    return Request(prompt_ids=tuple(request), params=SamplingParams() if params is None else params, **fields)


@dataclass(frozen=True)
class Resolved:
    """A checked request as the decoding loop runs it: the prompt, the params with the ids their min_tokens masks,
    max_new_tokens within the context, k, the ids that end generation and the logprobs asked for."""

    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    k: int | str
    stop_ids: frozenset[int]
    top_logprobs: int | None
    constraint: Constraint | None = None
    lookup_texts: tuple[tuple[int, ...], ...] = ()

    def new_result(self) -> GenerationResult:
        result = GenerationResult(token_ids=[], finish_reason="length")
        result.stats.prompt_tokens = len(self.prompt_ids)
        return result


def resolve(request: Request, *, max_length: int, vocab_size: int, eos_ids: frozenset[int],
            default_k: int | str, vocabulary: Any = None) -> Resolved:
    """Check `request` against a model of `max_length` tokens of context and `vocab_size` ids (ValueError with
    a one-line reason) and resolve it: k None is `default_k`, EOS ends generation unless ignored; the infill
    sampler reads `vocabulary` (verispec.core.infill.TokenPieces; None: the model has none to give)."""
    prompt = list(request.prompt_ids)
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed")
    if len(prompt) >= max_length:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {max_length}")
    if request.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"a prompt token id is out of range for the vocabulary of {vocab_size}")
    if any(min(text) < 0 or max(text) >= vocab_size for text in request.lookup_texts if text):
        raise ValueError(f"a lookup text's token id is out of range for the vocabulary of {vocab_size}")
    if any(token >= vocab_size for token, _ in request.params.logit_bias):
        raise ValueError(f"a logit_bias token id is out of range for the vocabulary of {vocab_size}")
    if request.logprobs is not None and request.logprobs < 0:
        raise ValueError(f"logprobs must be >= 0, got {request.logprobs}")
    if request.min_indent < 0:
        raise ValueError(f"min_indent must be >= 0, got {request.min_indent}")
    if request.newline_after is not None and not 0 <= request.newline_after < float("inf"):
        raise ValueError(f"newline_after must be a finite number of seconds >= 0, got {request.newline_after}")
    k = default_k if request.k is None else check_k(request.k)
    stop_ids = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else eos_ids)
    params = request.params.masking(stop_ids)  # min_tokens masks every id that would end generation here
    if params.infilling:
        if vocabulary is None:
            raise ValueError("the infill sampler needs the model's token texts, which this engine was not given")
        params = params.with_vocabulary(vocabulary)
    if request.constraint is not None:
        if params.infilling:
            raise ValueError("the infill sampler cannot be combined with structured output")
        if params.delays_stops:
            raise ValueError("min_tokens cannot be combined with structured output: the grammar says where it ends")
    max_new_tokens = min(request.max_new_tokens, max_length - len(prompt))
    return Resolved(prompt, params, max_new_tokens, k, stop_ids, request.logprobs, request.constraint,
                    request.lookup_texts)


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only (an EOS that ended generation included)
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when asked for


class Committed(list):
    """One round's newly committed token ids, with their provenance: the first `accepted` were drafted and
    accepted by the target; the rest (one, or none when a stop cut the round) the target produced itself
    (a recovered token after a rejection, or the bonus token after a fully accepted draft)."""

    def __init__(self, tokens: list[int], accepted: int) -> None:
        super().__init__(tokens)
        self.accepted = accepted

    @property
    def target(self) -> int:
        """How many of these tokens the target produced."""
        return len(self) - self.accepted
