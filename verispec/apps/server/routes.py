"""The server's routes, listed in ROUTES for create_app to register. Each reads what it needs from the
ServerState that create_app stores at `app.state.server` (verispec.apps.server.app).

A generation request is parsed, tokenised off the event loop, mapped to a Job (verispec.apps.server.generation)
and submitted to the worker; its answer is read from the job's events. While it waits, queued or running,
streaming or not, a watcher cancels the job once the client goes away.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.apps.server import responses
from verispec.apps.server.app import RETRY_AFTER_SECONDS, APIError, ServerState, parse_body
from verispec.apps.server.generation import chat_prompt, completion_prompt, generation_request
from verispec.apps.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from verispec.apps.server.responses import Reply
from verispec.apps.server.worker import Job, QueueFull, ShuttingDown, Worker
from verispec.pipeline.pipeline import Completion

STATIC = Path(__file__).parent / "static"
PAGE_FILES = {"": "index.html", "static/chat.js": "chat.js", "static/chat.css": "chat.css"}
# the page runs its own script and style and talks to this server only
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src data:; "
               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def tokenize(state: ServerState, fn, *args):
    """Tokenise or template off the event loop: a large prompt must not stall other requests."""
    return await asyncio.get_running_loop().run_in_executor(state.tokenizing, fn, *args)


def submit(worker: Worker, job: Job) -> None:
    """Queue the job, or refuse it: 429 when the queue is full, 503 when the worker is gone or going."""
    try:
        worker.submit(job)
    except QueueFull as exc:
        raise APIError(429, str(exc), code="server_busy", type_="server_error",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except ShuttingDown as exc:
        raise APIError(503, str(exc), code="server_unavailable", type_="server_error") from None


async def watch_disconnect(request: Request, worker: Worker, job: Job) -> None:
    """Wait for the client to go away (the body is read, so the next message is the disconnect), then
    cancel the job and wake its reader."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    worker.cancel(job)
    job.events.put_nowait(("cancelled", None))


async def wait(request: Request, worker: Worker, job: Job):
    """(kind, payload) of the job's last event: done, error, unavailable or cancelled."""
    watcher = asyncio.create_task(watch_disconnect(request, worker, job))
    try:
        while True:
            kind, payload = await job.events.get()
            if kind != "delta":
                return kind, payload
    finally:
        watcher.cancel()
        worker.cancel(job)


async def serve(request: Request, req: SamplingFields, job: Job, state: ServerState, chat: bool):
    """Submit the job and answer with its stream, or wait for its whole completion."""
    submit(state.worker, job)
    reply = Reply.new(req.model, chat)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(stream(request, job, reply, include_usage, state),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    state.metrics.in_progress.inc()
    try:
        kind, payload = await wait(request, state.worker, job)
    finally:
        state.metrics.in_progress.dec()
    if kind == "cancelled":
        return Response(status_code=499)  # nobody reads it: the client is gone
    if kind == "unavailable":
        raise APIError(503, payload, code="server_unavailable", type_="server_error")
    if kind == "error":
        raise APIError(500, payload, type_="server_error")
    result: Completion = payload
    return responses.completion_body(reply, job.text, result, len(job.request.prompt_ids),
                                     state.pipeline.tokenizer)


async def stream(request: Request, job: Job, reply: Reply, include_usage: bool, state: ServerState):
    """The job's events as server-sent events: pieces of text, then the final chunk (and the usage chunk when
    asked for) or an error event, then [DONE]; nothing more once the client has gone."""
    worker, metrics = state.worker, state.metrics
    metrics.in_progress.inc()
    watcher = asyncio.create_task(watch_disconnect(request, worker, job))
    try:
        if reply.chat:
            yield responses.event(responses.chunk(reply, include_usage, first=True))
        while True:
            kind, payload = await job.events.get()
            if kind == "delta":
                yield responses.event(responses.chunk(reply, include_usage, payload))
            elif kind == "cancelled":
                return
            elif kind in ("error", "unavailable"):
                yield responses.error_event(payload)
                break
            else:
                result: Completion = payload
                yield responses.event(responses.final_chunk(reply, include_usage, result))
                if include_usage:
                    yield responses.event(responses.usage_chunk(reply, len(job.request.prompt_ids), result))
                break
        yield responses.DONE
    finally:  # also when the client went away: the worker stops at its next round
        watcher.cancel()
        worker.cancel(job)
        metrics.in_progress.dec()


async def chat_completions(request: Request):
    return await _complete(request, ChatCompletionRequest, chat_prompt, chat=True)


async def completions(request: Request):
    return await _complete(request, CompletionRequest, completion_prompt, chat=False)


async def _complete(request: Request, model_cls, encode, chat: bool):
    """Parse, tokenise off the event loop, check and serve one completion request."""
    state = server_state(request)
    req = parse_body(await request.body(), model_cls)
    prompt_ids = await tokenize(state, encode, state.pipeline.tokenizer, req)
    job = Job(generation_request(req, prompt_ids, state), asyncio.get_running_loop())
    return await serve(request, req, job, state, chat=chat)


async def list_models(request: Request):
    state = server_state(request)
    pipeline, speculative = state.pipeline, state.speculative
    offered = {**state.setup, "drafters": [pipeline.drafter, "none"] if speculative else ["none"],
               "num_draft_tokens": pipeline.k if speculative else 0}
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "verispec",
                                        "verispec": offered} for name in state.settings.model_names]}


async def page(request: Request, name: str = ""):
    """The chat page and its script and style; no API key needed to load them (the page asks for one)."""
    path = request.url.path.lstrip("/")
    if path not in PAGE_FILES:
        raise StarletteHTTPException(404, "Not Found")
    return FileResponse(STATIC / PAGE_FILES[path], headers={"Content-Security-Policy": PAGE_POLICY,
                                                            "X-Content-Type-Options": "nosniff",
                                                            "Cache-Control": "no-cache"})


async def health(request: Request):
    worker = server_state(request).worker
    alive = worker.alive
    body = {"status": "ok" if alive else "unhealthy", "queue_length": len(worker.jobs),
            "busy": worker.current is not None, "running": len(worker.running)}
    return JSONResponse(body, status_code=200 if alive else 503)


async def prometheus_metrics(request: Request):
    return Response(generate_latest(server_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


# (path, endpoint, method), in the order paths are matched; the Guard labels metrics by these path templates
ROUTES = (
    ("/v1/chat/completions", chat_completions, "POST"),
    ("/v1/completions", completions, "POST"),
    ("/v1/models", list_models, "GET"),
    ("/static/{name}", page, "GET"),
    ("/", page, "GET"),
    ("/health", health, "GET"),
    ("/metrics", prometheus_metrics, "GET"),
)
