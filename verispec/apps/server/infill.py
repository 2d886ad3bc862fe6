"""llama-server's `POST /infill`, as editors' completion plugins call it (llama.vscode, llama.vim): the request,
its fill-in-the-middle prompt, and the answer in llama-server's own shape.

A request carries `input_prefix`, `input_suffix`, `input_extra` (other files: a list of {filename, text}),
`prompt` (text typed after the prefix, on the cursor's line), `n_predict`, `stream`, llama-server's sampling
fields under its names and defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05; `samplers` lists the
samplers that run: an option whose sampler is not listed is off, see names.options.from_llama_server), `stop`,
`n_indent` and `t_max_predict_ms` (the text layer's line rules), `n_cmpl` (several completions of one prompt),
`response_fields` (the answer cut down to these fields, "a/b" naming b inside a). The prompt is laid out as
llama-server lays it out (verispec.pipeline.fim) and fitted as it fits it: the prefix's end, the suffix's start,
and of the other files what the server's prompt limit leaves. Fields that only steer llama-server's own
scheduling (`cache_prompt`: verispec always keeps a slot's prefix; `id_slot`; `t_max_prompt_ms`, which
llama-server ignores too) are accepted; fields that would change the answer and are not honoured get a 400
naming them. Sampled options apply in verispec's order (temperature before top-k, top-p and min-p, as in
transformers and vLLM; llama.cpp applies the temperature last): greedy answers and those without the temperature
sampler are the same either way.

The answer: {content, tokens, id_slot, stop, model, tokens_predicted, tokens_evaluated, generation_settings,
prompt, has_new_line, truncated, stop_type (eos, word, limit), stopping_word, tokens_cached, timings} and
verispec's stats; streamed, one event per piece of text ({content, tokens, stop: false, ...}) and a last one
with stop: true and the rest, and no [DONE] (llama-server ends the stream without one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from verispec.apps.server.generation import check_vocabulary, max_tokens_within
from verispec.apps.server.protocol import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, APIError
from verispec.apps.server.responses import spec
from verispec.decoding.request import Request
from verispec.names.options import (
    LLAMA_SERVER_SAMPLERS,
    Bounds,
    SamplingParams,
    from_llama_server,
    llama_server_fields,
    option_types,
    sampling_options,
)
from verispec.pipeline.completion import Completion
from verispec.pipeline.fim import layout_of
from verispec.pipeline.provenance import Piece
from verispec.pipeline.text import INDENT, NEWLINE

if TYPE_CHECKING:
    from verispec.apps.server.state import ServerState

MAX_EXTRA_CHUNKS = 64  # files in input_extra (llama.vscode sends up to 16 by default)
MAX_COMPLETIONS = 8  # n_cmpl

# fields llama-server takes that would change the answer and are not honoured here -> is this value harmless?
UNSUPPORTED = {
    "grammar": lambda v: not v,
    "json_schema": lambda v: not v,
    "logit_bias": lambda v: not v,
    "n_probs": lambda v: not v,
    "lora": lambda v: not v,
    "mirostat": lambda v: not v,
    "dry_multiplier": lambda v: not v,
    "xtc_probability": lambda v: not v,
    "typical_p": lambda v: v is None or v >= 1,
    "top_n_sigma": lambda v: v is None or v <= 0,
    "dynatemp_range": lambda v: not v,
    "n_keep": lambda v: v is None or v in (0, -1),
    "n_discard": lambda v: not v,
}


class ExtraFile(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    text: str
    filename: str = Field("tmp", max_length=1024)


def _sampling_fields() -> dict:
    """llama-server's sampling fields, each with llama-server's default and the server's bounds (OpenAI's where the
    API has the option, else the library's)."""
    types, options = option_types(), sampling_options()
    return {field: (types[name], Field(default, **(options[name].api_bounds or options[name].bounds or Bounds())
                                       .pydantic())) for field, (name, default) in llama_server_fields().items()}


InfillSampling = create_model("InfillSampling", __config__=ConfigDict(extra="ignore", strict=True),
                              **_sampling_fields())


class InfillRequest(InfillSampling):
    model_config = ConfigDict(extra="ignore", strict=True)
    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraFile] = Field([], max_length=MAX_EXTRA_CHUNKS)
    prompt: str = ""
    n_predict: int = Field(-1, ge=-1)
    stream: bool = False
    stop: list[str] = Field([], max_length=MAX_STOP_SEQUENCES)
    ignore_eos: bool = False
    samplers: list[str] = list(LLAMA_SERVER_SAMPLERS)
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = -1
    n_cmpl: int | None = Field(None, ge=1, le=MAX_COMPLETIONS)
    n: int | None = Field(None, ge=1, le=MAX_COMPLETIONS)
    response_fields: list[str] = []
    model: str | None = None
    # steer llama-server's scheduling only
    cache_prompt: bool = True
    id_slot: int = -1
    t_max_prompt_ms: int = -1

    def sampling(self) -> SamplingParams:
        """The request's sampling options as the library's (ValueError: a value or sampler it refuses)."""
        return from_llama_server({field: getattr(self, field) for field in llama_server_fields()}, self.samplers)

    @property
    def completions(self) -> int:
        return self.n_cmpl or self.n or 1


def unsupported_field(data: dict) -> str | None:
    """The first field of a raw /infill body that asks for something not honoured here, else None."""
    return next((name for name, harmless in UNSUPPORTED.items() if name in data and not harmless(data[name])), None)


def infill_prompt(tokenizer, req: InfillRequest, max_prompt_tokens: int, n_ctx: int) -> list[int]:
    """The FIM prompt, fitted as llama-server fits it (FimLayout.fitted): the prefix's end, the suffix's start, and
    of the other files what the prompt limit leaves, room kept for n_predict tokens in the context."""
    try:
        layout = layout_of(tokenizer)
    except ValueError as exc:
        raise APIError(400, str(exc), "input_prefix", "fim_not_supported") from None
    limit = min(max_prompt_tokens, n_ctx - 1 - max(req.n_predict, 0))
    extra = [(f.filename, f.text) for f in req.input_extra]
    return layout.fitted(tokenizer, req.input_prefix, req.input_suffix, extra, req.prompt, limit)


def infill_request(req: InfillRequest, prompt_ids: list[int], state: ServerState, seed_offset: int = 0) -> Request:
    """The library's Request for an /infill request whose prompt is `prompt_ids` (its `seed_offset`-th
    completion: a seeded request's completions draw from seed, seed + 1, ...). n_predict -1 is the server's
    default max_tokens; 0 fills the slot's cache with the prompt and answers nothing (one token is computed)."""
    try:
        params = req.sampling()
    except ValueError as exc:
        raise APIError(400, str(exc), "samplers" if "sampler" in str(exc) else None) from None
    check_vocabulary(params, state, "samplers")
    params = params.nth(seed_offset)
    if any(not s or len(s) > MAX_STOP_CHARS for s in req.stop):
        raise APIError(400, f"a stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    asked = None if req.n_predict < 0 else max(1, req.n_predict)
    max_tokens = max_tokens_within(asked, len(prompt_ids), state.settings, state.n_ctx, "n_predict", "input_prefix")
    newline_after = req.t_max_predict_ms / 1000 if req.t_max_predict_ms > 0 else None
    if req.stream and req.completions > 1:
        raise APIError(400, "n_cmpl > 1 is not supported when streaming", "n_cmpl")
    return Request(prompt_ids=prompt_ids, params=params, max_new_tokens=max_tokens,
                   k=state.pipeline.k if state.speculative else 0, stop=tuple(req.stop),
                   min_indent=req.n_indent, newline_after=newline_after, ignore_eos=req.ignore_eos)


@dataclass(frozen=True)
class InfillAnswer:
    """llama-server's answer to /infill (see the module's docstring): whole, or streamed without [DONE].
    `n_ctx`: the context a request has (its generation settings say it); `index`: which of the request's
    completions."""

    req: InfillRequest
    model: str
    tokenizer: Any
    prompt_ids: list[int]
    n_ctx: int
    index: int = 0

    done = ""

    def opening(self) -> list[dict]:
        return []

    def piece(self, piece: Piece) -> dict:
        return {"index": self.index, "content": piece.text, "tokens": [], "stop": False, "id_slot": 0,
                "tokens_predicted": piece.tokens, "tokens_evaluated": len(self.prompt_ids),
                "verispec": {"accepted": piece.accepted, "target": piece.target,
                             "spans": [list(span) for span in piece.spans]}}

    def closing(self, result: Completion, n_prompt: int) -> list[dict]:
        return [self._final("", [], result)]

    def body(self, text: str, result: Completion, n_prompt: int) -> dict:
        return self._fields(self._final(text, result.token_ids, result))

    def _final(self, content: str, tokens: list[int], result: Completion) -> dict:
        s, n_new = result.stats, len(result.token_ids)
        if self.req.n_predict == 0:  # a cache fill: its token is not part of the answer
            content, tokens, n_new = "", [], 0
        ended = result.stop_reason
        if result.finish_reason != "stop" or (ended in (INDENT, NEWLINE) and ended not in self.req.stop):
            stop_type, word = "limit", ""
        elif ended is not None:
            stop_type, word = "word", ended
        else:
            stop_type, word = "eos", ""
        decode = max(s.seconds - s.prefill_seconds, 0.0)
        prompt_n = s.prompt_tokens - s.cached_tokens
        timings = {"cache_n": s.cached_tokens, "prompt_n": prompt_n, "prompt_ms": s.prefill_seconds * 1e3,
                   "prompt_per_token_ms": s.prefill_seconds * 1e3 / prompt_n if prompt_n else 0.0,
                   "prompt_per_second": prompt_n / s.prefill_seconds if s.prefill_seconds else 0.0,
                   "predicted_n": n_new, "predicted_ms": decode * 1e3,
                   "predicted_per_token_ms": decode * 1e3 / n_new if n_new else 0.0,
                   "predicted_per_second": n_new / decode if decode else 0.0,
                   "draft_n": s.drafted, "draft_n_accepted": s.accepted}
        settings = {"n_ctx": self.n_ctx, "n_predict": self.req.n_predict, "stream": self.req.stream,
                    "stop": self.req.stop, "n_indent": self.req.n_indent, "t_max_predict_ms": self.req.t_max_predict_ms,
                    "samplers": self.req.samplers, **{f: getattr(self.req, f) for f in llama_server_fields()}}
        return {"index": self.index, "content": content, "tokens": list(tokens), "id_slot": 0, "stop": True,
                "model": self.model, "tokens_predicted": n_new, "tokens_evaluated": len(self.prompt_ids),
                "generation_settings": settings,
                "prompt": self.tokenizer.decode(self.prompt_ids, skip_special_tokens=False),
                "has_new_line": "\n" in content, "truncated": False, "stop_type": stop_type,
                "stopping_word": word, "tokens_cached": len(self.prompt_ids) + n_new, "timings": timings,
                "verispec": spec(result)}

    def _fields(self, body: dict) -> dict:
        """The body cut down to `response_fields` ("a/b": b inside a, under the key "a/b"), when asked."""
        if not self.req.response_fields:
            return body
        out = {}
        for path in self.req.response_fields:
            value, found = body, True
            for key in path.split("/"):
                if isinstance(value, dict) and key in value:
                    value = value[key]
                else:
                    found = False
                    break
            if found:
                out[path] = value
        return out
