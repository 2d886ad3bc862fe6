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
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.apps.server.guard import Guard, GuardSettings
from verispec.apps.server.metrics import Metrics
from verispec.apps.server.protocol import APIError, error_body, validation_message
from verispec.apps.server.routes import ROUTES
from verispec.apps.server.settings import ServerSettings
from verispec.apps.server.state import RETRY_AFTER_SECONDS, ServerState
from verispec.apps.server.worker import Worker
from verispec.backends.threads import release_openmp_threads
from verispec.pipeline.pipeline import Pipeline

SHUTDOWN_MESSAGE = "the server is shutting down"


def context_length(pipeline: Pipeline) -> int:
    """Tokens the pair can hold: the target's context, or the draft model's when that is shorter."""
    return pipeline.context_length


# -- every error in OpenAI's format ---------------------------------------------------------------------


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.param, exc.code, exc.type, exc.headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(exc)
    return _error(400, message, param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(exc.status_code, str(exc.detail), type_=type_, headers=getattr(exc, "headers", None))


async def _internal(request: Request, exc: Exception) -> JSONResponse:  # never a plain-text 500
    return _error(500, f"internal error: {type(exc).__name__}", type_="server_error")


EXCEPTION_HANDLERS = ((APIError, _api_error), (RequestValidationError, _invalid),
                      (StarletteHTTPException, _http_error), (Exception, _internal))


# -- the app ---------------------------------------------------------------------------------------------


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Start the worker; on the way out stop it and the tokenizing thread. A shutdown signal calls
    `app.state.on_exit` first (verispec.apps.server.run), which answers the waiting requests with 503 at once."""
    state: ServerState = app.state.server
    loop = asyncio.get_running_loop()
    app.state.on_exit = lambda: loop.call_soon_threadsafe(state.worker.refuse_waiting, SHUTDOWN_MESSAGE)
    release_openmp_threads()  # the models were loaded on this thread: its OpenMP team goes (backends.threads)
    state.worker.start()
    yield
    await loop.run_in_executor(None, state.worker.stop)
    state.tokenizing.shutdown(wait=False)


def _setup(pipeline: Pipeline, settings: ServerSettings, worker: Worker) -> dict:
    """/v1/models' extension field: what runs (backend, drafter, k) and why, and how many requests decode at once."""
    setup = pipeline.setup()
    setup["max_batch"] = worker.max_batch
    if settings.max_batch > 1 and worker.max_batch == 1:
        setup["batching"] = f"one request at a time: {pipeline.batch_reason}"
    return setup


def create_app(pipeline: Pipeline, settings: ServerSettings) -> FastAPI:
    metrics = Metrics()
    worker = Worker(pipeline, settings.max_queue, metrics, settings.max_batch)
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verispec-tokenize")
    docs = {} if settings.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="verispec", lifespan=lifespan, **docs)
    app.state.server = ServerState(pipeline, settings, worker, metrics, tokenizing,
                                   _setup(pipeline, settings, worker), context_length(pipeline),
                                   pipeline.engine.target.vocab_size)
    app.state.metrics, app.state.worker = metrics, worker
    guard = GuardSettings(settings.max_body_bytes, settings.api_key, settings.allowed_hosts, settings.max_in_flight,
                          RETRY_AFTER_SECONDS)
    app.add_middleware(Guard, settings=guard, app_routes=app, metrics=metrics)
    for exc_class, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_class, handler)
    for path, endpoint, method in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
    return app
