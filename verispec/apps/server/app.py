"""The FastAPI application: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, and a chat
page at / (verispec/apps/server/static: one HTML file with its script and style, nothing fetched from elsewhere).

Streamed chunks that carry generated tokens (finish_reason null) carry an extension field with their tokens'
provenance (verispec.pipeline.provenance):

    "verispec": {"accepted": 2, "target": 1, "spans": [["Hel", "draft"], ["lo", "draft"], [" world", "target"]]}

`accepted`: how many of the chunk's tokens were drafted and accepted; `target`: how many the target produced
(recovered or bonus tokens). `spans`: one [text, "draft" | "target"] per token, in order; their texts
concatenate to the chunk's content (chat: delta.content; completions: text). A token whose text is empty
(a special token) or cut (one completing a stop string) has a span with empty or shortened text, so a chunk
may carry tokens and no text. Over a stream, accepted + target adds up to usage.completion_tokens and
accepted to the final stats' accepted. The final chunk (finish_reason set) carries the generation's stats
instead: {"acceptance_rate", "mean_accepted_length", "drafted", "accepted", "rounds", "tokens_per_second"},
as does the usage chunk when stream_options.include_usage asks for one. /v1/models lists, per model, the
drafters a request may ask for ("drafter": the server's own, or "none" for plain decoding) and the default k.

Every refusal is a 4xx in OpenAI's error format; every request whose client goes away (queued, running,
streaming or not) is cancelled within one round. The request guard (verispec.apps.server.guard) checks
headers and bounds the body before any of this runs.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.apps.server.guard import Guard, GuardSettings
from verispec.apps.server.metrics import Metrics
from verispec.apps.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_json_shape,
    error_body,
    unsupported_field,
)
from verispec.apps.server.worker import Job, QueueFull, ShuttingDown, Worker
from verispec.backends.threads import release_openmp_threads
from verispec.core.sampling import SamplingParams
from verispec.decoding.request import Request as GenerationRequest
from verispec.pipeline.pipeline import Completion, Pipeline
from verispec.pipeline.provenance import Piece
from verispec.pipeline.text import encode_messages

RETRY_AFTER_SECONDS = 1
STATIC = Path(__file__).parent / "static"
PAGE_FILES = {"": "index.html", "static/chat.js": "chat.js", "static/chat.css": "chat.css"}
# the page runs its own script and style and talks to this server only
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src data:; "
               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass(frozen=True)
class ServerSettings:
    model_names: tuple[str, ...]
    max_queue: int = 64
    max_prompt_tokens: int = 8192
    max_tokens_cap: int = 4096
    default_max_tokens: int = 512
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")  # "*": any Host header
    enable_docs: bool = False
    max_in_flight: int = 256  # requests handled at once (streams included); beyond it 429
    max_batch: int = 1  # sequences decoded together (continuous batching), where the pipeline can batch

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_prompt_tokens", "max_tokens_cap", "default_max_tokens", "max_body_bytes",
                     "max_in_flight", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.allowed_hosts:
            raise ValueError("allowed_hosts is empty: no request could be served (use '*' to allow any)")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers


def _validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return (f"invalid value for '{param}': {err.get('msg')}" if param else str(err.get("msg"))), param


def context_length(pipeline: Pipeline) -> int:
    """Tokens the pair can hold: the target's context, or the draft model's when that is shorter."""
    return pipeline.context_length


def parse_body(raw: bytes, model_cls):
    """A validated request model from a raw body, or APIError(400) saying what is wrong with it."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None
    except ValueError:  # bad JSON, bad UTF-8, an integer of thousands of digits
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    problem = check_json_shape(data)
    if problem:
        raise APIError(400, problem)
    field = unsupported_field(data)
    if field:
        raise APIError(400, f"'{field}' is not supported by this server", field, "unsupported_parameter")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise APIError(400, message, param) from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None


def create_app(pipeline: Pipeline, settings: ServerSettings) -> FastAPI:
    metrics = Metrics()
    worker = Worker(pipeline, settings.max_queue, metrics, settings.max_batch)
    speculative = pipeline.draft is not None
    n_ctx = context_length(pipeline)
    vocab_size = pipeline.generator.target.vocab_size
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verispec-tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        app.state.on_exit = lambda: loop.call_soon_threadsafe(worker.refuse_waiting, SHUTDOWN_MESSAGE)
        release_openmp_threads()  # the models were loaded on this thread: its OpenMP team goes (backends.threads)
        worker.start()
        yield
        await loop.run_in_executor(None, worker.stop)
        tokenizing.shutdown(wait=False)

    docs = {} if settings.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="verispec", lifespan=lifespan, **docs)
    app.state.metrics, app.state.worker = metrics, worker
    guard = GuardSettings(settings.max_body_bytes, settings.api_key, settings.allowed_hosts, settings.max_in_flight,
                          RETRY_AFTER_SECONDS)
    app.add_middleware(Guard, settings=guard, app_routes=app, metrics=metrics)

    def error(status: int, message: str, param: str | None = None, code: str | None = None,
              type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc.status, exc.message, exc.param, exc.code, exc.type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), type_=type_, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # never a plain-text 500
        return error(500, f"internal error: {type(exc).__name__}", type_="server_error")

    async def _tokenize(fn, *args):
        """Tokenise or template off the event loop: a large prompt must not stall other requests."""
        return await asyncio.get_running_loop().run_in_executor(tokenizing, fn, *args)

    def _prompt_param(req) -> str:
        return "messages" if isinstance(req, ChatCompletionRequest) else "prompt"

    def _max_tokens(req, n_prompt: int) -> int:
        """The request's max_tokens, checked against the cap and the context (vLLM's rule: prompt plus
        completion must fit); unasked, the default clipped to what the context has left."""
        if n_prompt > settings.max_prompt_tokens or n_prompt >= n_ctx:
            limit = min(settings.max_prompt_tokens, n_ctx - 1)
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens and prompts may have at most "
                                f"{limit} tokens; your prompt has {n_prompt} tokens.", _prompt_param(req),
                           "context_length_exceeded")
        asked = req.requested_max_tokens()
        if asked is None:
            return min(settings.default_max_tokens, n_ctx - n_prompt)
        if asked > settings.max_tokens_cap:
            raise APIError(400, f"max_tokens is {asked}; the limit is {settings.max_tokens_cap}", "max_tokens")
        if n_prompt + asked > n_ctx:
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                                f"{n_prompt + asked} tokens ({n_prompt} in the prompt, {asked} for the completion). "
                                f"Please reduce the length of the prompt or completion.", "max_tokens",
                           "context_length_exceeded")
        return asked

    def _params(req) -> SamplingParams:
        try:
            return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                                  repetition_penalty=req.repetition_penalty, seed=req.seed,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  min_tokens=req.min_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def _job(req, prompt_ids: list[int]) -> Job:
        if req.model not in settings.model_names:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                                f"{', '.join(settings.model_names)}", "model", "model_not_found")
        max_tokens = _max_tokens(req, len(prompt_ids))
        if req.drafter not in (None, "none") and req.drafter != pipeline.drafter:
            raise APIError(400, f"this server drafts with '{pipeline.drafter}'; ask for that or 'none'", "drafter")
        stop_ids = tuple(req.stop_token_ids or ())
        if any(t >= vocab_size for t in stop_ids):
            raise APIError(400, f"a stop token id is outside the vocabulary of {vocab_size}", "stop_token_ids")
        logprobs = req.logprobs_count()
        if logprobs is not None and req.stream:
            raise APIError(400, "logprobs are not supported when streaming", "logprobs")
        k = 0 if req.drafter == "none" else req.num_draft_tokens
        if k is None:
            k = pipeline.generator.num_draft_tokens if speculative else 0
        request = GenerationRequest(prompt_ids=prompt_ids, params=_params(req), max_new_tokens=max_tokens,
                                    num_draft_tokens=k, stop=req.stop_list(), stop_token_ids=stop_ids,
                                    ignore_eos=req.ignore_eos, logprobs=logprobs)
        return Job(request, asyncio.get_running_loop())

    def _submit(job: Job) -> None:
        try:
            worker.submit(job)
        except QueueFull as exc:
            raise APIError(429, str(exc), code="server_busy", type_="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), code="server_unavailable", type_="server_error") from None

    async def _watch_disconnect(request: Request, job: Job) -> None:
        """Wait for the client to go away (the body is read, so the next message is the disconnect), then
        cancel the job and wake its reader."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        worker.cancel(job)
        job.events.put_nowait(("cancelled", None))

    def _usage(job: Job, result: Completion) -> dict:
        n_prompt, n_new = len(job.request.prompt_ids), len(result.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}

    def _spec(result: Completion) -> dict:
        s = result.stats
        return {"acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
                "drafted": s.drafted, "accepted": s.accepted, "rounds": s.rounds,
                "tokens_per_second": s.tokens_per_second}

    def _token_text(token: int) -> str:
        return pipeline.tokenizer.decode([token])

    def _logprobs(result: Completion, chat: bool) -> dict | None:
        """OpenAI's logprobs object from the target's processed distribution at each generated position."""
        if result.logprobs is None:
            return None
        entries = list(zip(result.token_ids, result.logprobs))
        if chat:
            def item(token: int, logprob: float) -> dict:
                text = _token_text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [item(t, lp) | {"top_logprobs": [item(a, alp) for a, alp in top]}
                                for t, (lp, top) in entries]}
        tokens = [_token_text(t) for t, _ in entries]
        offsets = [0]
        for text in tokens[:-1]:
            offsets.append(offsets[-1] + len(text))
        return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in entries],
                "top_logprobs": [{_token_text(a): alp for a, alp in top} for _, (_, top) in entries],
                "text_offset": offsets}

    async def _wait(request: Request, job: Job):
        """(kind, payload) of the job's last event: done, error, unavailable or cancelled."""
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            while True:
                kind, payload = await job.events.get()
                if kind != "delta":
                    return kind, payload
        finally:
            watcher.cancel()
            worker.cancel(job)

    async def _serve(request: Request, req, job: Job, chat: bool):
        _submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(request, job, rid, created, req.model, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        metrics.in_progress.inc()
        try:
            kind, payload = await _wait(request, job)
        finally:
            metrics.in_progress.dec()
        if kind == "cancelled":
            return Response(status_code=499)  # nobody reads it: the client is gone
        if kind == "unavailable":
            raise APIError(503, payload, code="server_unavailable", type_="server_error")
        if kind == "error":
            raise APIError(500, payload, type_="server_error")
        result: Completion = payload
        choice = ({"index": 0, "message": {"role": "assistant", "content": job.text}} if chat
                  else {"index": 0, "text": job.text})
        choice["logprobs"] = _logprobs(result, chat)
        choice["finish_reason"] = result.finish_reason
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": req.model, "choices": [choice], "usage": _usage(job, result), "verispec": _spec(result)}

    async def _stream(request: Request, job: Job, rid: str, created: int, model: str, chat: bool,
                      include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: Piece | None, finish: str | None = None, first: bool = False) -> str:
            delta = None if piece is None else piece.text
            if chat:
                d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta is not None else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            if piece is not None:
                body["verispec"] = {"accepted": piece.accepted, "target": piece.target,
                                    "spans": [list(span) for span in piece.spans]}
            return f"data: {json.dumps(body)}\n\n"

        metrics.in_progress.inc()
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            if chat:
                yield chunk(None, first=True)
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    yield chunk(payload)
                elif kind == "cancelled":
                    return
                elif kind in ("error", "unavailable"):
                    yield f"data: {json.dumps(error_body(payload, 'server_error'))}\n\n"
                    break
                else:
                    result: Completion = payload
                    final = json.loads(chunk(None, result.finish_reason)[len("data: "):])
                    final["verispec"] = _spec(result)
                    yield f"data: {json.dumps(final)}\n\n"
                    if include_usage:
                        usage = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                 "usage": _usage(job, result), "verispec": _spec(result)}
                        yield f"data: {json.dumps(usage)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: the worker stops at its next round
            watcher.cancel()
            worker.cancel(job)
            metrics.in_progress.dec()

    def _chat_prompt(req: ChatCompletionRequest) -> list[int]:
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in req.messages]
            return encode_messages(pipeline.tokenizer, messages)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        except Exception as exc:  # a chat template that rejects this conversation (e.g. role order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None

    def _completion_prompt(req: CompletionRequest) -> list[int]:
        if not req.prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        prompt_ids = list(pipeline.tokenizer(req.prompt).input_ids)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty after tokenisation", "prompt")
        return prompt_ids

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(await request.body(), ChatCompletionRequest)
        prompt_ids = await _tokenize(_chat_prompt, req)
        return await _serve(request, req, _job(req, prompt_ids), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(await request.body(), CompletionRequest)
        prompt_ids = await _tokenize(_completion_prompt, req)
        return await _serve(request, req, _job(req, prompt_ids), chat=False)

    setup = pipeline.setup()  # an extension field: what runs (backend, drafter, k) and why
    setup["max_batch"] = worker.max_batch
    if settings.max_batch > 1 and worker.max_batch == 1:
        setup["batching"] = f"one request at a time: {pipeline.can_batch()}"

    @app.get("/v1/models")
    async def list_models():
        offered = {**setup, "drafters": [pipeline.drafter, "none"] if speculative else ["none"],
                   "num_draft_tokens": pipeline.generator.num_draft_tokens if speculative else 0}
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "verispec",
                                            "verispec": offered} for name in settings.model_names]}

    @app.get("/")
    @app.get("/static/{name}")
    async def page(request: Request, name: str = ""):
        """The chat page and its script and style; no API key needed to load them (the page asks for one)."""
        path = request.url.path.lstrip("/")
        if path not in PAGE_FILES:
            raise StarletteHTTPException(404, "Not Found")
        return FileResponse(STATIC / PAGE_FILES[path], headers={"Content-Security-Policy": PAGE_POLICY,
                                                                "X-Content-Type-Options": "nosniff",
                                                                "Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        alive = worker.alive
        body = {"status": "ok" if alive else "unhealthy", "queue_length": len(worker.jobs),
                "busy": worker.current is not None, "running": len(worker.running)}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
