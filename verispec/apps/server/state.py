"""What the server's routes read: `ServerState`, built once by create_app (verispec.apps.server.app) and kept at
`app.state.server`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from verispec.apps.server.metrics import Metrics
from verispec.apps.server.settings import ServerSettings
from verispec.apps.server.worker import Worker
from verispec.pipeline.pipeline import Pipeline

RETRY_AFTER_SECONDS = 1  # a 429's Retry-After


@dataclass(frozen=True)
class ServerState:
    """What the routes (verispec.apps.server.routes) read, at `app.state.server`: built once by create_app."""

    pipeline: Pipeline
    settings: ServerSettings
    worker: Worker
    metrics: Metrics
    tokenizing: ThreadPoolExecutor  # one thread: tokenisation and chat templates, off the event loop
    setup: dict  # /v1/models' extension field: what runs (backend, drafter, k, batching) and why
    n_ctx: int
    vocab_size: int

    @property
    def speculative(self) -> bool:
        return self.pipeline.draft is not None
