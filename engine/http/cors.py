"""CORS as llama-server does it: the outermost ASGI middleware of the head's app.

- Every response names the allowed origin (`Access-Control-Allow-Origin`): with `--cors-origins *`
  (the default) the request's `Origin` is reflected, credentials allowed; with `localhost` only an
  Origin whose host is localhost, 127.0.0.1 or ::1 is; otherwise the Origin is reflected when the
  comma-separated list names it (llama-server sends the flag's text as is, which a browser accepts
  only for a single origin: the same outcome).
- A preflight is any `OPTIONS` request, on any path: 200 with an empty body and the allowed
  credentials, methods and headers, answered here, before `http_gate.Gate`: a browser sends no
  API key on a preflight, and the model need not be loaded.

starlette's CORSMiddleware cannot say this: it echoes the requested headers instead of `*`,
refuses an unknown origin's preflight with 400 and passes an `OPTIONS` without
`Access-Control-Request-Method` on to the routes (405).
"""

from __future__ import annotations

from urllib.parse import urlsplit

ALLOW_METHODS = b"GET, POST, DELETE, OPTIONS"  # llama-server's --cors-methods default
ALLOW_HEADERS = b"*"  # its --cors-headers default
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def is_localhost(origin: str) -> bool:
    try:
        return urlsplit(origin).hostname in LOCAL_HOSTS
    except ValueError:
        return False


class Cors:
    def __init__(self, app, *, origins: str = "*"):
        self.app = app
        self.origins = origins
        self.listed = frozenset(o.strip() for o in origins.split(",") if o.strip())

    def allowed(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for a request from `origin`, or None."""
        if not origin:
            return None
        if self.origins == "*":
            return origin
        if self.origins == "localhost":
            return origin if is_localhost(origin) else None
        return origin if origin in self.listed else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = dict(scope["headers"]).get(b"origin", b"").decode("latin-1")
        allowed = self.allowed(origin)
        # Spelled as llama-server sends them: clients that read headers into a plain dict compare names exactly.
        cors = [(b"Access-Control-Allow-Origin", allowed.encode("latin-1")), (b"Vary", b"Origin")] if allowed else []
        if scope["method"] == "OPTIONS":
            headers = [
                *cors,
                (b"Access-Control-Allow-Credentials", b"true"),
                (b"Access-Control-Allow-Methods", ALLOW_METHODS),
                (b"Access-Control-Allow-Headers", ALLOW_HEADERS),
                (b"content-type", b"text/html"),
                (b"content-length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
