"""From an OpenAI request to what the library runs: the prompt's token ids (the chat template or the tokenizer)
and one verispec Request. Each refusal is an APIError (a 4xx) naming the field at fault. The prompt functions and
`lookup_texts` run on the tokenizing thread (the tokenizer is used from that thread alone); `generation_request` on
the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verispec.apps.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from verispec.core.sampling import SamplingParams
from verispec.decoding.request import Request
from verispec.pipeline.fim import layout_of
from verispec.pipeline.text import encode_messages, json_string_texts
from verispec.pipeline.tools import ToolFormat, history_message

if TYPE_CHECKING:
    from verispec.apps.server.settings import ServerSettings
    from verispec.apps.server.state import ServerState


def chat_prompt(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """The conversation through the model's chat template, with the tools it may call (a 400 where the template
    renders none in a format verispec reads, verispec.pipeline.tools)."""
    tools = req.offered_tools()
    if tools and ToolFormat.of(tokenizer) is None:
        raise APIError(400, "this model's chat template does not render tools in the <tool_call> format verispec "
                            "reads (Qwen2.5, Qwen3, Hermes)", "tools")
    try:
        messages = [history_message({"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                                     "tool_calls": [c.model_dump() for c in m.tool_calls or []],
                                     "tool_call_id": m.tool_call_id})
                    for m in req.messages]
        return encode_messages(tokenizer, messages, tools or None)
    except ValueError as exc:
        raise APIError(400, str(exc), "messages") from None
    except Exception as exc:  # a chat template that rejects this conversation (e.g. role order)
        raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None


def completion_prompt(tokenizer, req: CompletionRequest) -> list[int]:
    """The prompt's ids; with a (non-empty) suffix, the fill-in-the-middle prompt of the prompt and the suffix
    (verispec.pipeline.fim), a 400 for a model without FIM tokens."""
    if req.suffix:  # an empty suffix, OpenAI's default, asks for a plain completion
        if req.n > 1:
            raise APIError(400, "fill in the middle (suffix) takes one choice: n must be 1", "n")
        try:
            return layout_of(tokenizer).encode(tokenizer, req.prompt, req.suffix)
        except ValueError as exc:
            raise APIError(400, str(exc), "suffix", "fim_not_supported") from None
    if not req.prompt:
        raise APIError(400, "the prompt is empty", "prompt")
    prompt_ids = list(tokenizer(req.prompt).input_ids)
    if not prompt_ids:
        raise APIError(400, "the prompt is empty after tokenisation", "prompt")
    return prompt_ids


def max_new_tokens(req: SamplingFields, n_prompt: int, settings: ServerSettings, n_ctx: int) -> int:
    """The request's max_tokens, checked against the cap and the context (see max_tokens_within)."""
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    return max_tokens_within(req.requested_max_tokens(), n_prompt, settings, n_ctx, "max_tokens", prompt_param)


def max_tokens_within(asked: int | None, n_prompt: int, settings: ServerSettings, n_ctx: int, param: str,
                      prompt_param: str) -> int:
    """`asked` new tokens (the request's field `param`), checked against the cap and the context (vLLM's rule:
    prompt plus completion must fit); None: the server's default clipped to what the context has left. A prompt
    over the server's limit or the context is refused too (naming `prompt_param`)."""
    if n_prompt > settings.max_prompt_tokens or n_prompt >= n_ctx:
        limit = min(settings.max_prompt_tokens, n_ctx - 1)
        raise APIError(400, f"This model's maximum context length is {n_ctx} tokens and prompts may have at most "
                            f"{limit} tokens; your prompt has {n_prompt} tokens.", prompt_param,
                       "context_length_exceeded")
    if asked is None:
        return min(settings.default_max_tokens, n_ctx - n_prompt)
    if asked > settings.max_tokens_cap:
        raise APIError(400, f"{param} is {asked}; the limit is {settings.max_tokens_cap}", param)
    if n_prompt + asked > n_ctx:
        raise APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                            f"{n_prompt + asked} tokens ({n_prompt} in the prompt, {asked} for the completion). "
                            f"Please reduce the length of the prompt or completion.", param,
                       "context_length_exceeded")
    return asked


def sampling_params(req: SamplingFields, state: ServerState) -> SamplingParams:
    """The request's sampling options; a value the library refuses is a 400."""
    try:
        params = req.sampling()
    except ValueError as exc:
        raise APIError(400, str(exc), "logit_bias" if "logit_bias" in str(exc) else None) from None
    if any(token >= state.vocab_size for token, _ in params.logit_bias):
        raise APIError(400, f"a logit_bias token id is outside the vocabulary of {state.vocab_size}", "logit_bias")
    check_vocabulary(params, state, "infill_sampler")
    return params


def check_vocabulary(params: SamplingParams, state: ServerState, param: str) -> None:
    """A 400 when the params ask for the infill sampler and the model's token texts are not at hand."""
    if params.infilling and state.pipeline.engine.vocabulary is None:
        raise APIError(400, "the infill sampler needs the model's token texts (a fast tokenizer)", param)


def lookup_texts(tokenizer, req: SamplingFields) -> tuple[tuple[int, ...], ...]:
    """The prompt's strings as a JSON answer writes them (Request.lookup_texts), where the answer is JSON: under a
    JSON response_format, or in a chat that offers tools (a call's arguments are JSON, required or not)."""
    tools = isinstance(req, ChatCompletionRequest) and req.tool_mode() != "none"
    try:
        constraint = req.constraint()[0]
    except ValueError:  # generation_request refuses it
        return ()
    if not tools and (constraint is None or not constraint.is_json):
        return ()
    strings = [m.text() for m in req.messages] if isinstance(req, ChatCompletionRequest) else [req.prompt]
    return json_string_texts(tokenizer, strings)


def generation_request(req: SamplingFields, prompt_ids: list[int], state: ServerState,
                       texts: tuple[tuple[int, ...], ...] = ()) -> Request:
    """The library's Request for an OpenAI request whose prompt is `prompt_ids` (and lookup texts `texts`), after
    the checks only the server can make: the model's name, the length against the context, the drafter, the stop
    ids against the vocabulary, no logprobs while streaming. k: none for drafter "none", else the request's or the
    server's."""
    settings, pipeline = state.settings, state.pipeline
    if req.model not in settings.model_names:
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                            f"{', '.join(settings.model_names)}", "model", "model_not_found")
    max_tokens = max_new_tokens(req, len(prompt_ids), settings, state.n_ctx)
    if req.drafter not in (None, "none") and req.drafter != pipeline.drafter:
        raise APIError(400, f"this server drafts with '{pipeline.drafter}'; ask for that or 'none'", "drafter")
    stop_ids = tuple(req.stop_token_ids or ())
    if any(t >= state.vocab_size for t in stop_ids):
        raise APIError(400, f"a stop token id is outside the vocabulary of {state.vocab_size}", "stop_token_ids")
    logprobs = req.logprobs_count()
    if logprobs is not None and req.stream:
        raise APIError(400, "logprobs are not supported when streaming", "logprobs")
    k = 0 if req.drafter == "none" else req.num_draft_tokens
    if k is None:
        k = pipeline.k if state.speculative else 0
    try:
        constraint, _ = req.constraint()
    except ValueError as exc:
        raise APIError(400, str(exc), "response_format") from None
    if isinstance(req, ChatCompletionRequest) and req.tool_mode() in ("required", "named"):
        if constraint is not None:
            raise APIError(400, "a required tool call cannot be combined with structured output", "tool_choice")
        constraint = ToolFormat.of(pipeline.tokenizer).constraint(
            req.called_tools(), parallel=req.parallel_tool_calls and req.tool_mode() == "required")
    return Request(prompt_ids=prompt_ids, params=sampling_params(req, state), max_new_tokens=max_tokens,
                   k=k, stop=req.stop_list(), stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
                   logprobs=logprobs, constraint=constraint, lookup_texts=texts)


def check_request(state: ServerState, request: Request, req: SamplingFields) -> None:
    """What only the engine can check (a grammar compiles, min_tokens fits it): a 400 naming the field. Runs on the
    tokenizing thread, so compiling a grammar stalls neither the event loop nor the decode loop."""
    try:
        state.pipeline.engine.resolve(request)
    except ValueError as exc:
        param = req.constraint()[1] or ("tools" if isinstance(req, ChatCompletionRequest) else None)
        raise APIError(400, str(exc), param) from None
