"""The request guard: a plain ASGI middleware in front of every route.

It answers, before the application sees a request: a Host header not in the allow-list (a web page that
rebinds a DNS name to 127.0.0.1), a POST that is not application/json (a page's cross-site "simple"
request), a missing or wrong API key, and a body over the limit, counted while it is read (a chunked body
has no Content-Length), and a request beyond `max_in_flight` at once (429 with Retry-After, in JSON like
every refusal: uvicorn's own concurrency limit, set above this one as a backstop, answers a plain-text
503). It counts every response under its route template, so unknown paths share one metric series. Being plain ASGI (no BaseHTTPMiddleware), it passes the client's disconnect through.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from starlette.routing import Match

from verispec.apps.server.metrics import UNMATCHED
from verispec.apps.server.protocol import error_body


@dataclass(frozen=True)
class GuardSettings:
    max_body_bytes: int
    api_key: str | None
    allowed_hosts: tuple[str, ...]  # host names without port; "*" allows any
    max_in_flight: int = 0  # requests handled at once beyond which a new one gets 429; 0: no limit
    retry_after_seconds: int = 1


class Refused(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers


def host_name(host: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '::1', 'Example.COM' -> 'example.com'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _send_error(send, status: int, message: str, type_: str, code: str | None,
                      extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(error_body(message, type_, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, settings: GuardSettings, app_routes, metrics) -> None:
        self.app, self.settings, self.routes_of, self.metrics = app, settings, app_routes, metrics
        self._expected_auth = f"Bearer {settings.api_key}".encode() if settings.api_key else None
        self._in_flight = 0  # requests past the checks, not yet answered (one event loop: no lock needed)

    def _route(self, scope) -> str:
        """The template of the route the path belongs to (also when only the method is wrong), else one label."""
        for route in self.routes_of.router.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                return getattr(route, "path", UNMATCHED)
        return UNMATCHED

    def _check_headers(self, scope, headers: dict[bytes, bytes]) -> None:
        s = self.settings
        if s.max_in_flight and self._in_flight >= s.max_in_flight:
            raise Refused(429, f"the server is handling {s.max_in_flight} requests; retry shortly",
                          "rate_limit_error", "too_many_requests",
                          ((b"retry-after", str(s.retry_after_seconds).encode()),))
        if "*" not in s.allowed_hosts and host_name(headers.get(b"host", b"").decode("latin-1")) not in s.allowed_hosts:
            raise Refused(400, "the Host header is not one this server answers to (see --allowed-hosts)")
        path = scope["path"]
        if self._expected_auth is not None and path.startswith("/v1/") and not secrets.compare_digest(
                headers.get(b"authorization", b""), self._expected_auth):
            raise Refused(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
        if scope["method"] == "POST":
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                raise Refused(415, "the body must be sent as Content-Type: application/json")
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > s.max_body_bytes):
                raise Refused(413, f"request body larger than {s.max_body_bytes} bytes")

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, refused (413) as soon as it passes the limit; None if the client went away."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                raise Refused(413, f"request body larger than {self.settings.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route(scope)
        status = [0]

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            self._check_headers(scope, dict(scope["headers"]))
        except Refused as exc:
            await _send_error(counted_send, exc.status, exc.message, exc.type, exc.code, exc.headers)
            self._count(route, status[0])
            return
        self._in_flight += 1
        try:
            body = await self._read_body(receive) if scope["method"] in ("POST", "PUT", "PATCH") else b""
            if body is not None:
                await self.app(scope, _replay(body, receive), counted_send)
        except Refused as exc:
            await _send_error(counted_send, exc.status, exc.message, exc.type, exc.code, exc.headers)
        finally:
            self._in_flight -= 1
            self._count(route, status[0])

    def _count(self, route: str, status: int) -> None:
        if status:
            self.metrics.requests.labels(route, str(status)).inc()


def _replay(body: bytes, receive):
    """A receive that hands the app the body already read, then the client's own messages (the disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
