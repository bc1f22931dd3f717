"""Every request body is read as JSON, whatever its declared Content-Type (llama-server's way).

`curl -d '{...}'` without `-H 'Content-Type: application/json'` declares
application/x-www-form-urlencoded, as many copy-pasted examples do; FastAPI parses a body as JSON only
under a JSON type and would refuse that one as "not a valid dictionary". `JsonBody`, an ASGI
middleware, declares the body JSON before the routes see it. A body that is not JSON then fails to
parse: a 400 in OpenAI's error shape, like any malformed JSON (api.py's validation handler).
"""

from __future__ import annotations

JSON = b"application/json"


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == JSON or media.endswith(b"+json")


class JsonBody:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and any(k == b"content-type" and not _is_json(v) for k, v in scope["headers"]):
            headers = [(k, JSON if k == b"content-type" else v) for k, v in scope["headers"]]
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)
