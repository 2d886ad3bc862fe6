"""The bodies the server answers with, in OpenAI's shapes plus the "verispec" extension fields (described in
verispec.apps.server.app): a whole completion, the chunks of a stream as server-sent events, usage, the
generation's stats and OpenAI's logprobs objects. Pure functions of a finished or streaming generation: no
worker, no request, no I/O.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace

from verispec.apps.server.protocol import error_body
from verispec.pipeline.pipeline import Completion
from verispec.pipeline.provenance import Piece
from verispec.pipeline.tools import ToolCall, may_start_call, parse_calls

DONE = "data: [DONE]\n\n"  # the event that ends every stream


@dataclass(frozen=True)
class Reply:
    """What every body of one answer shares: its id, when it was created, the model asked for, and whether it
    answers /v1/chat/completions (chat) or /v1/completions."""

    id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> Reply:
        return cls(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), model, chat)


def usage(n_prompt: int, *results: Completion) -> dict:
    """OpenAI's usage of one prompt and the completions of its choices; of the prompt's tokens, those the first
    choice found in the cache (a common prefix kept from an earlier request, or another choice's prefill)."""
    return {**token_counts(n_prompt, sum(len(result.token_ids) for result in results)),
            "prompt_tokens_details": {"cached_tokens": results[0].stats.cached_tokens}}


def token_counts(n_prompt: int, n_new: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}


def spec(result: Completion) -> dict:
    """The generation's speculation stats (the "verispec" field of a completion and of a stream's last chunks)."""
    s = result.stats
    return {"acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
            "drafted": s.drafted, "accepted": s.accepted, "rounds": s.rounds,
            "tokens_per_second": s.tokens_per_second}


def logprobs(result: Completion, chat: bool, tokenizer) -> dict | None:
    """OpenAI's logprobs object from the target's processed distribution at each generated position."""
    if result.logprobs is None:
        return None

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    entries = list(zip(result.token_ids, result.logprobs))
    if chat:
        def item(token: int, logprob: float) -> dict:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [item(t, lp) | {"top_logprobs": [item(a, alp) for a, alp in top]}
                            for t, (lp, top) in entries]}
    tokens = [token_text(t) for t, _ in entries]
    offsets = [0]
    for text in tokens[:-1]:
        offsets.append(offsets[-1] + len(text))
    return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in entries],
            "top_logprobs": [{token_text(a): alp for a, alp in top} for _, (_, top) in entries],
            "text_offset": offsets}


def completion_body(reply: Reply, text: str, result: Completion, n_prompt: int, tokenizer) -> dict:
    """The whole answer of a request that did not stream."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if reply.chat
              else {"index": 0, "text": text})
    choice["logprobs"] = logprobs(result, reply.chat, tokenizer)
    choice["finish_reason"] = result.finish_reason
    return {"id": reply.id, "object": "chat.completion" if reply.chat else "text_completion",
            "created": reply.created, "model": reply.model, "choices": [choice], "usage": usage(n_prompt, result),
            "verispec": spec(result)}


def _chunk_object(reply: Reply) -> str:
    return "chat.completion.chunk" if reply.chat else "text_completion"


def chunk(reply: Reply, include_usage: bool, piece: Piece | None = None, finish: str | None = None,
          first: bool = False) -> dict:
    """One streamed chunk: the chat stream's opening role (first), a piece of text with its tokens' provenance,
    or (piece None) an empty delta with the finish reason."""
    delta = None if piece is None else piece.text
    if reply.chat:
        d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta is not None else {})
        choice = {"index": 0, "delta": d, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
    body = {"id": reply.id, "object": _chunk_object(reply), "created": reply.created, "model": reply.model,
            "choices": [choice]}
    if include_usage:
        body["usage"] = None
    if piece is not None:
        body["verispec"] = {"accepted": piece.accepted, "target": piece.target,
                            "spans": [list(span) for span in piece.spans]}
    return body


def final_chunk(reply: Reply, include_usage: bool, result: Completion) -> dict:
    """The chunk that ends the generation: its finish reason and stats."""
    return chunk(reply, include_usage, finish=result.finish_reason) | {"verispec": spec(result)}


def usage_chunk(reply: Reply, n_prompt: int, *results: Completion) -> dict:
    """The chunk stream_options.include_usage asks for: no choices, the usage of every choice's completion (`results`)
    and the first one's stats."""
    return {"id": reply.id, "object": _chunk_object(reply), "created": reply.created, "model": reply.model,
            "choices": [], "usage": usage(n_prompt, *results), "verispec": spec(results[0])}


@dataclass(frozen=True)
class OpenAIAnswer:
    """How /v1/chat/completions and /v1/completions answer (see verispec.apps.server.routes' `serve`): a whole
    completion body, or a stream of chunks ending with the final chunk, the usage chunk when asked for, and
    [DONE]."""

    reply: Reply
    include_usage: bool
    tokenizer: object

    done = DONE

    def opening(self) -> list[dict]:
        return [chunk(self.reply, self.include_usage, first=True)] if self.reply.chat else []

    def piece(self, piece: Piece) -> dict:
        return chunk(self.reply, self.include_usage, piece)

    def closing(self, result: Completion, n_prompt: int) -> list[dict]:
        last = [final_chunk(self.reply, self.include_usage, result)]
        return last + ([usage_chunk(self.reply, n_prompt, result)] if self.include_usage else [])

    def body(self, text: str, result: Completion, n_prompt: int) -> dict:
        return completion_body(self.reply, text, result, n_prompt, self.tokenizer)


class ToolCallAnswer(OpenAIAnswer):
    """A chat answer where the model may call tools (verispec.pipeline.tools): its calls come back as
    `message.tool_calls` with `finish_reason: "tool_calls"`, streamed as `delta.tool_calls` (one chunk per call, whole,
    as OpenAI's SDK accumulates them); text that may begin a call is held back from the streamed content until it is
    known not to."""

    def __init__(self, reply: Reply, include_usage: bool, tokenizer: object) -> None:
        super().__init__(reply, include_usage, tokenizer)
        object.__setattr__(self, "_stream", {"text": "", "shown": 0})

    def piece(self, piece: Piece) -> dict:
        held = self._stream
        held["text"] += piece.text
        start = may_start_call(held["text"])
        visible = held["text"] if start < 0 else held["text"][:start]
        new, held["shown"] = visible[held["shown"]:], max(held["shown"], len(visible))
        return chunk(self.reply, self.include_usage, replace(piece, text=new))

    def closing(self, result: Completion, n_prompt: int) -> list[dict]:
        content, calls = parse_calls(result.text)
        bodies = []
        if not calls:
            rest = result.text[self._stream["shown"]:]
            if rest:
                bodies.append(chunk(self.reply, self.include_usage, Piece(rest, 0, 0)))
            return bodies + super().closing(result, n_prompt)
        for index, call in enumerate(calls):
            delta = {"tool_calls": [{"index": index} | tool_call(call)]}
            body = chunk(self.reply, self.include_usage)
            body["choices"][0]["delta"] = delta
            bodies.append(body)
        last = final_chunk(self.reply, self.include_usage, result)
        last["choices"][0]["finish_reason"] = _finish(result)
        return bodies + [last] + ([usage_chunk(self.reply, n_prompt, result)] if self.include_usage else [])

    def body(self, text: str, result: Completion, n_prompt: int) -> dict:
        body = super().body(text, result, n_prompt)
        content, calls = parse_calls(text)
        if calls:
            choice = body["choices"][0]
            choice["message"] = {"role": "assistant", "content": content,
                                 "tool_calls": [tool_call(call) for call in calls]}
            choice["finish_reason"] = _finish(result)
        return body


def tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish(result: Completion) -> str:
    """A generation that ended on its own after calls ended to call them; one cut by max_tokens says so."""
    return "tool_calls" if result.finish_reason == "stop" else result.finish_reason


def as_choice(body: dict, index: int) -> dict:
    """A body of one choice (a chunk or a whole answer) as the choice `index` of several."""
    for choice in body["choices"]:
        choice["index"] = index
    return body


def merge_choices(bodies: list[dict]) -> dict:
    """The whole answer of n choices from each choice's body: the choices in order, the usage added up (the prompt
    once), the first choice's stats."""
    merged = dict(bodies[0])
    merged["choices"] = [as_choice(body, i)["choices"][0] for i, body in enumerate(bodies)]
    merged["usage"] = {**bodies[0]["usage"], **token_counts(bodies[0]["usage"]["prompt_tokens"],
                                                            sum(body["usage"]["completion_tokens"] for body in bodies))}
    return merged


def error_event(message: str) -> str:
    """A failure after the stream began (its status is already sent): an error body as the last event."""
    return event(error_body(message, "server_error"))


def event(body: dict) -> str:
    """A server-sent event carrying `body`."""
    return f"data: {json.dumps(body)}\n\n"
