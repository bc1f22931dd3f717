"""What every HTTP request to the head passes before and after its route: the API key, the body size
limit, and one log line. A pure ASGI middleware, so a body is counted as it streams in (never read
whole first) and a refusal costs no parsing.

- API key (`--api-key`): `Authorization: Bearer KEY` or `X-Api-Key: KEY`, compared in constant
  time; 401 otherwise. /health, /status and /metrics stay public: the console and load balancers
  poll them.
- Body limit (`--max-body`): 413 on a Content-Length above it before reading, or as soon as a
  chunked body passes it (the receive wrapper raises a 413 HTTPException, which FastAPI passes on
  to the app's handler).
- Drain: once SIGTERM's drain closes the API (`http/drain.py`), 503 + Retry-After.
- Log: one line per API request (id, endpoint, HTTP status, tokens in/out, ms, and why it failed);
  a traceback only for an unexpected exception, which becomes a 500 here. The routes fill the
  tokens and a streamed failure's reason in through `record_of(request)`; any other refusal's
  reason is read back from its OpenAI-shaped body.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from starlette.exceptions import HTTPException
from starlette.requests import Request

from ..errors import describe
from .drain import Drain
from .errors import error_response

log = logging.getLogger("hydra.http")

PUBLIC_PATHS = frozenset({"/health", "/status", "/metrics"})  # no key, no log line (polled every second)
REASON_PEEK = 4096  # bytes of an error body read back for its message


@dataclass
class RequestRecord:
    """One request's log line, filled in on the way."""

    method: str
    path: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    t0: float = field(default_factory=time.perf_counter)
    status: int = 0
    tokens_in: int | None = None
    tokens_out: int | None = None
    reason: str | None = None

    def usage(self, usage: dict | None) -> None:
        if usage:
            self.tokens_in, self.tokens_out = usage.get("prompt_tokens"), usage.get("completion_tokens")

    def line(self) -> str:
        ms = (time.perf_counter() - self.t0) * 1e3
        tokens = f" in={self.tokens_in} out={self.tokens_out}" if self.tokens_in is not None else ""
        why = f" reason={self.reason!r}" if self.reason else ""
        return f"{self.id} {self.method} {self.path} {self.status}{tokens} {ms:.0f}ms{why}"


def record_of(request: Request) -> RequestRecord | None:
    return request.scope.get("state", {}).get("hydra_request")


class Gate:
    def __init__(self, app, *, api_key: str | None, max_body: int, drain: Drain | None = None):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.drain = drain  # once it is closing (SIGTERM), every API request gets 503

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        rec = RequestRecord(scope["method"], scope["path"])
        scope.setdefault("state", {})["hydra_request"] = rec
        started = False
        peek = bytearray()

        async def send_logged(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                rec.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rec.id.encode())]}
            elif message["type"] == "http.response.body" and rec.status >= 400 and len(peek) < REASON_PEEK:
                peek.extend(message.get("body", b"")[: REASON_PEEK - len(peek)])
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send_logged)
            else:
                await self.app(scope, self._limited(scope, receive), send_logged)
        except Exception as e:  # a bug: the one place it is logged with its traceback
            rec.reason = describe(e)
            log.exception("%s %s %s failed", rec.id, rec.method, rec.path)
            if not started:
                await error_response(500, f"internal error: {describe(e)}", "server_error")(scope, receive, send_logged)
            else:
                rec.status = rec.status or 500
        finally:
            if rec.reason is None and peek:
                rec.reason = _error_message(bytes(peek))
            failed = rec.status >= 400 or rec.reason is not None
            log.log(logging.WARNING if failed else logging.INFO, "%s", rec.line())

    def _refusal(self, scope):
        """The error response for a request refused on its headers alone, or None."""
        headers = dict(scope["headers"])
        if self.key is not None and not self._authorized(headers):
            return error_response(401, "Invalid API Key", "authentication_error", code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return error_response(400, "Content-Length is not a number", "invalid_request_error")
            if n > self.max_body:
                return error_response(413, self.too_large, "invalid_request_error")
        if self.drain is not None and self.drain.closing:
            return self.drain.refusal().response()
        return None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, self.key)

    def _limited(self, scope, receive):
        """`receive`, counting body bytes: past the limit the read fails with a 413."""
        seen = 0

        async def receive_limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise HTTPException(413, self.too_large)
            return message

        return receive_limited

    @property
    def too_large(self) -> str:
        return f"request body exceeds --max-body ({self.max_body} bytes)"


def _error_message(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
