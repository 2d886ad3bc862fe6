"""The FastAPI application: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import ValidationError

from verispec.engine import GenerationResult
from verispec.pipeline import Pipeline
from verispec.sampling import SamplingParams
from verispec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from verispec.server.worker import Job, QueueFull, Worker
from verispec.text import encode_messages


@dataclass(frozen=True)
class ServerSettings:
    model_names: tuple[str, ...]
    max_queue: int = 64
    max_prompt_tokens: int = 8192
    max_tokens_cap: int = 4096
    default_max_tokens: int = 512
    max_body_bytes: int = 1 << 20
    api_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_prompt_tokens", "max_tokens_cap", "default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("verispec_requests_total", "HTTP requests", ["endpoint", "status"], registry=r)
        self.tokens = Counter("verispec_generated_tokens_total", "tokens generated", registry=r)
        self.drafted = Counter("verispec_drafted_tokens_total", "draft tokens proposed", registry=r)
        self.accepted = Counter("verispec_accepted_tokens_total", "draft tokens accepted", registry=r)
        self.acceptance_length = Histogram(
            "verispec_acceptance_length", "tokens committed per verification round (accepted + 1)",
            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 33), registry=r)
        self.time_per_token = Histogram(
            "verispec_time_per_output_token_seconds", "generation time per output token",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=r)
        self.queue_length = Gauge("verispec_queue_length", "requests waiting for the model", registry=r)
        self.in_progress = Gauge("verispec_requests_in_progress", "requests being served", registry=r)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return (f"invalid value for '{param}': {err.get('msg')}" if param else str(err.get("msg"))), param


def create_app(pipeline: Pipeline, settings: ServerSettings) -> FastAPI:
    metrics = Metrics()
    worker = Worker(pipeline, settings.max_queue, metrics)
    speculative = pipeline.generator.proposer is not None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.metrics, app.state.worker = metrics, worker

    def error(status: int, message: str, param: str | None = None, code: str | None = None,
              type_: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc.status, exc.message, exc.param, exc.code, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error(400, message, param)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        endpoint = request.url.path
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            response = error(413, f"request body larger than {settings.max_body_bytes} bytes")
        elif settings.api_key and endpoint.startswith("/v1/") and not secrets.compare_digest(
                request.headers.get("authorization", ""), f"Bearer {settings.api_key}"):
            response = error(401, "invalid or missing API key", code="invalid_api_key", type_="authentication_error")
        else:
            try:
                response = await call_next(request)
            except Exception as exc:  # never let one request crash the server
                response = error(500, f"internal error: {type(exc).__name__}", type_="server_error")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _body(request: Request, model_cls):
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            raise APIError(413, f"request body larger than {settings.max_body_bytes} bytes")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise APIError(400, message, param) from None

    def _job(req, prompt_ids: list[int]) -> Job:
        if req.model not in settings.model_names:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                                f"{', '.join(settings.model_names)}", "model", "model_not_found")
        if len(prompt_ids) > settings.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; the limit is {settings.max_prompt_tokens}",
                           "messages" if isinstance(req, ChatCompletionRequest) else "prompt", "context_length_exceeded")
        max_tokens = req.requested_max_tokens() or settings.default_max_tokens
        if max_tokens > settings.max_tokens_cap:
            raise APIError(400, f"max_tokens is {max_tokens}; the limit is {settings.max_tokens_cap}", "max_tokens")
        if req.drafter not in (None, "none") and req.drafter != pipeline.drafter:
            raise APIError(400, f"this server drafts with '{pipeline.drafter}'; ask for that or 'none'", "drafter")
        k = 0 if req.drafter == "none" else req.num_draft_tokens
        if k is None:
            k = pipeline.generator.num_draft_tokens if speculative else 0
        try:
            params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                                    repetition_penalty=req.repetition_penalty, seed=req.seed)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return Job(prompt_ids, params, max_tokens, k, req.stop_list(), asyncio.get_running_loop())

    def _submit(job: Job) -> None:
        try:
            worker.submit(job)
        except QueueFull as exc:
            raise APIError(429 if "busy" in str(exc) else 503, str(exc), code="server_busy", type_="server_error")

    def _usage(job: Job, result: GenerationResult) -> dict:
        n_prompt, n_new = len(job.prompt_ids), len(result.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}

    def _spec(result: GenerationResult) -> dict:
        s = result.stats
        return {"acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
                "drafted": s.drafted, "accepted": s.accepted, "rounds": s.rounds,
                "tokens_per_second": s.tokens_per_second}

    async def _serve(request: Request, req, job: Job, chat: bool):
        _submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(job, rid, created, req.model, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        metrics.in_progress.inc()
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancelled.set()
                        return Response(status_code=499)
                    continue
                if kind == "error":
                    raise APIError(503, payload, type_="server_error")
                if kind == "done":
                    break
        finally:
            metrics.in_progress.dec()
            job.cancelled.set()
        result: GenerationResult = payload
        choice = ({"index": 0, "message": {"role": "assistant", "content": job.text}} if chat
                  else {"index": 0, "text": job.text, "logprobs": None})
        choice["finish_reason"] = result.finish_reason
        return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
                "usage": _usage(job, result), "verispec": _spec(result)}

    async def _stream(job: Job, rid: str, created: int, model: str, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, first: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta is not None else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        metrics.in_progress.inc()
        try:
            if chat:
                yield chunk(None, first=True)
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    yield chunk(payload)
                elif kind == "error":
                    yield f"data: {json.dumps(error_body(payload, 'server_error'))}\n\n"
                    break
                else:
                    result: GenerationResult = payload
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
            job.cancelled.set()
            metrics.in_progress.dec()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _body(request, ChatCompletionRequest)
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in req.messages]
            prompt_ids = encode_messages(pipeline.tokenizer, messages)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        except Exception as exc:  # a chat template that rejects this conversation (e.g. role order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        return await _serve(request, req, _job(req, prompt_ids), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _body(request, CompletionRequest)
        if not req.prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        prompt_ids = list(pipeline.tokenizer(req.prompt).input_ids)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty after tokenisation", "prompt")
        return await _serve(request, req, _job(req, prompt_ids), chat=False)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "verispec"}
                                           for name in settings.model_names]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "queue_length": worker.jobs.qsize(), "busy": worker.current is not None}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
