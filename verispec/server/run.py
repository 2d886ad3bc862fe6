"""Run the app under uvicorn with a graceful shutdown that exits 0."""

from __future__ import annotations

import contextlib
import signal

import uvicorn


class GracefulServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop accepting, let in-flight requests finish (up to the graceful timeout), shut the
    worker down, and return normally (uvicorn itself would re-raise the signal after shutting down)."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app, host: str, port: int, log_level: str = "info", graceful_timeout: int = 30) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout)
    GracefulServer(config).run()
