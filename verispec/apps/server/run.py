"""Run the app under uvicorn with a graceful shutdown that exits 0."""

from __future__ import annotations

import contextlib
import signal

import uvicorn


class GracefulServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop accepting, answer the requests still waiting for the model with 503 at once
    (the app's `state.on_exit`), let running ones finish (up to the graceful timeout), shut the worker down,
    and return normally (uvicorn itself would re-raise the signal after shutting down)."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        on_exit = getattr(self.config.app.state, "on_exit", None)
        if on_exit is not None:
            on_exit()
        super().handle_exit(sig, frame)


def serve(app, host: str, port: int, log_level: str = "info", graceful_timeout: int = 30,
          limit_concurrency: int | None = None) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                            limit_concurrency=limit_concurrency)
    GracefulServer(config).run()
