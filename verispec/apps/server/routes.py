"""The server's routes, listed in ROUTES for create_app to register. Each reads what it needs from the
ServerState that create_app stores at `app.state.server` (verispec.apps.server.app).

A generation request is parsed, tokenised off the event loop, mapped to a Job (verispec.apps.server.generation)
and submitted to the worker; its answer is read from the job's events. While it waits, queued or running,
streaming or not, a watcher cancels the job once the client goes away.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.apps.server import responses
from verispec.apps.server.generation import (
    chat_prompt,
    check_request,
    completion_prompt,
    generation_request,
    lookup_texts,
)
from verispec.apps.server.infill import InfillAnswer, InfillRequest, infill_prompt, infill_request
from verispec.apps.server.infill import unsupported_field as infill_unsupported
from verispec.apps.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from verispec.apps.server.responses import Reply
from verispec.apps.server.state import RETRY_AFTER_SECONDS, ServerState
from verispec.apps.server.worker import Job, QueueFull, ShuttingDown, Worker
from verispec.pipeline.pipeline import Completion
from verispec.pipeline.provenance import Piece

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


def submit_all(worker: Worker, jobs: list[Job]) -> None:
    """Queue every job of one request, or none of them (the refusal of `submit`)."""
    try:
        for job in jobs:
            submit(worker, job)
    except APIError:
        for job in jobs:
            worker.cancel(job)
        raise


async def watch_disconnect(request: Request, worker: Worker, jobs: list[Job]) -> None:
    """Wait for the client to go away (the body is read, so the next message is the disconnect), then
    cancel its jobs and wake their readers."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        worker.cancel(job)
        job.events.put_nowait(("cancelled", None))


async def _last_event(job: Job):
    while True:
        kind, payload = await job.events.get()
        if kind != "delta":
            return kind, payload


async def wait(request: Request, worker: Worker, jobs: list[Job]) -> list[tuple[str, object]]:
    """(kind, payload) of each job's last event (done), or, as soon as one job ends otherwise (error, unavailable,
    cancelled: the client went away), that event alone; the jobs still running are cancelled."""
    watcher = asyncio.create_task(watch_disconnect(request, worker, jobs))
    waiting = {asyncio.ensure_future(_last_event(job)): i for i, job in enumerate(jobs)}
    events: list = [None] * len(jobs)
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                events[waiting.pop(task)] = event = task.result()
                if event[0] != "done":
                    return [event]
        return events
    finally:
        _stop(watcher, waiting, worker, jobs)


def _stop(watcher: asyncio.Task, readers, worker: Worker, jobs: list[Job]) -> None:
    """A request's answer is over (or its client gone): stop watching it and reading its jobs, cancel what runs."""
    watcher.cancel()
    for task in readers:
        task.cancel()
    for job in jobs:
        worker.cancel(job)


class Answer(Protocol):
    """How an endpoint writes a generation's answer: its whole `body`, or a stream of events (`opening` ones, one
    per `piece` of text, the `closing` ones, then `done`). OpenAI's (responses.OpenAIAnswer) and llama-server's
    /infill (infill.InfillAnswer)."""

    done: str

    def opening(self) -> list[dict]: ...

    def piece(self, piece: Piece) -> dict: ...

    def closing(self, result: Completion, n_prompt: int) -> list[dict]: ...

    def body(self, text: str, result: Completion, n_prompt: int) -> dict: ...


async def serve(request: Request, job: Job, state: ServerState, answer: Answer, streamed: bool):
    """Submit the job and answer with its stream, or wait for its whole completion."""
    submit(state.worker, job)
    if streamed:
        return StreamingResponse(stream(request, job, answer, state), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    bodies = await wait_bodies(request, [job], state, [answer])
    return bodies if isinstance(bodies, Response) else bodies[0]


async def wait_bodies(request: Request, jobs: list[Job], state: ServerState, answers: list[Answer]):
    """Each submitted job's whole answer, once all are done (a Response for a client that went away)."""
    state.metrics.in_progress.inc()
    try:
        events = await wait(request, state.worker, jobs)
    finally:
        state.metrics.in_progress.dec()
    if events[0][0] == "cancelled":
        return Response(status_code=499)  # nobody reads it: the client is gone
    if len(events) < len(jobs):  # one failed: its error answers the request
        finished(*events[0])
    return [answer.body(job.text, finished(kind, payload), len(job.request.prompt_ids))
            for job, answer, (kind, payload) in zip(jobs, answers, events)]


def finished(kind: str, payload) -> Completion:
    """A job's Completion from its last event, or the APIError its failure answers with."""
    if kind == "unavailable":
        raise APIError(503, payload, code="server_unavailable", type_="server_error")
    if kind == "error":
        raise APIError(500, payload, type_="server_error")
    return payload


async def stream(request: Request, job: Job, answer: Answer, state: ServerState):
    """The job's events as server-sent events: the answer's opening, pieces of text, then its closing events or
    an error event, then its end; nothing more once the client has gone."""
    worker, metrics = state.worker, state.metrics
    metrics.in_progress.inc()
    watcher = asyncio.create_task(watch_disconnect(request, worker, [job]))
    try:
        for body in answer.opening():
            yield responses.event(body)
        while True:
            kind, payload = await job.events.get()
            if kind == "delta":
                yield responses.event(answer.piece(payload))
            elif kind == "cancelled":
                return
            elif kind in ("error", "unavailable"):
                yield responses.error_event(payload)
                break
            else:
                for body in answer.closing(payload, len(job.request.prompt_ids)):
                    yield responses.event(body)
                break
        yield answer.done
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
    texts = await tokenize(state, lookup_texts, state.pipeline.tokenizer, req)
    job = Job(generation_request(req, prompt_ids, state, texts), asyncio.get_running_loop())
    if job.request.constraint is not None:  # compiled on the tokenizing thread: a 400 for a bad one
        await tokenize(state, check_request, state, job.request, req)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    kind = responses.ToolCallAnswer if chat and req.tool_mode() != "none" else responses.OpenAIAnswer
    reply = Reply.new(req.model, chat)
    if req.n == 1:
        return await serve(request, job, state, kind(reply, include_usage, state.pipeline.tokenizer), req.stream)
    return await serve_choices(request, job, req.n, state, lambda: kind(reply, include_usage, state.pipeline.tokenizer),
                               req.stream)


async def serve_choices(request: Request, job: Job, n: int, state: ServerState, make_answer, streamed: bool):
    """n choices of one request: rows of the worker's batch, each drawing with its own seed (a given seed is
    seed + i for choice i); greedy choices are one generation, copied (they are the same)."""
    loop, params = asyncio.get_running_loop(), job.request.params
    jobs = [job] if params.greedy else [Job(replace(job.request, params=params.nth(i)), loop) for i in range(n)]
    answers = [make_answer() for _ in range(n)]
    submit_all(state.worker, jobs)
    if streamed:
        return StreamingResponse(stream_choices(request, jobs, answers, state), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    bodies = await wait_bodies(request, jobs, state, answers[: len(jobs)])
    if isinstance(bodies, Response):
        return bodies
    bodies += [answers[i].body(jobs[0].text, jobs[0].result, len(job.request.prompt_ids)) for i in range(len(jobs), n)]
    return responses.merge_choices(bodies)


async def stream_choices(request: Request, jobs: list[Job], answers: list, state: ServerState):
    """The chunks of every choice, as their jobs produce them, each naming its choice's index; the usage chunk
    (when asked for) adds the choices' tokens up."""
    worker, metrics, n = state.worker, state.metrics, len(answers)
    copies = n if len(jobs) == 1 else 1  # greedy: one job's chunks for every choice
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(i: int, job: Job) -> None:
        while True:
            event = await job.events.get()
            await merged.put((i, event))
            if event[0] != "delta":
                return

    metrics.in_progress.inc()
    watcher = asyncio.create_task(watch_disconnect(request, worker, jobs))
    readers = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
    results, n_prompt = [], len(jobs[0].request.prompt_ids)
    try:
        for i, answer in enumerate(answers):
            for body in answer.opening():
                yield responses.event(responses.as_choice(body, i))
        running = len(jobs)
        while running:
            i, (kind, payload) = await merged.get()
            targets = range(n) if copies > 1 else (i,)
            if kind == "delta":
                for c in targets:
                    yield responses.event(responses.as_choice(answers[c].piece(payload), c))
                continue
            running -= 1
            if kind == "cancelled":
                return
            if kind in ("error", "unavailable"):
                yield responses.error_event(payload)
                break
            for c in targets:
                results.append(payload)
                for body in answers[c].closing(payload, n_prompt):
                    if body["choices"]:  # the choices' usage comes once, after all of them
                        yield responses.event(responses.as_choice(body, c))
        else:
            if answers[0].include_usage:
                yield responses.event(responses.usage_chunk(answers[0].reply, n_prompt, *results))
        yield responses.DONE
    finally:
        _stop(watcher, readers, worker, jobs)
        metrics.in_progress.dec()


async def infill(request: Request):
    """llama-server's /infill (verispec.apps.server.infill): one completion, streamed or not, or n_cmpl of them
    (a list; greedy completions are one generation, copied: they are the same)."""
    state = server_state(request)
    req = parse_body(await request.body(), InfillRequest, infill_unsupported)
    tokenizer = state.pipeline.tokenizer
    ids = await tokenize(state, infill_prompt, tokenizer, req, state.settings.max_prompt_tokens, state.n_ctx)
    name, loop = req.model or state.settings.model_names[0], asyncio.get_running_loop()
    jobs = [Job(infill_request(req, ids, state, i), loop) for i in range(req.completions)]
    if req.completions == 1:
        return await serve(request, jobs[0], state, InfillAnswer(req, name, tokenizer, ids, state.n_ctx), req.stream)
    if jobs[0].request.params.greedy:  # one generation answers as every completion
        jobs = jobs[:1]
    submit_all(state.worker, jobs)
    answers = [InfillAnswer(req, name, tokenizer, ids, state.n_ctx, i) for i in range(req.completions)]
    bodies = await wait_bodies(request, jobs, state, answers[: len(jobs)])
    if isinstance(bodies, Response):
        return bodies
    return bodies + [answer.body(jobs[0].text, jobs[0].result, len(ids)) for answer in answers[len(bodies):]]


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
    ("/infill", infill, "POST"),
    ("/v1/models", list_models, "GET"),
    ("/static/{name}", page, "GET"),
    ("/", page, "GET"),
    ("/health", health, "GET"),
    ("/metrics", prometheus_metrics, "GET"),
)
