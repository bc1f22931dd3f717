"""`Wake`: the ASGI middleware behind the gate that holds a head with `--sleep-idle-seconds` awake
for each request (workers/idle_sleep.py), loading its model again first if it sleeps.

Reads that need no model neither wake it nor count as activity: llama-server's list (GET /health,
/props, /models, /metrics) and ours, /v1/models and /status, which the console polls. Every other
request wakes it, as llama-server's do (/tokenize, /slots too). A model that cannot be loaded again
answers 503 in OpenAI's shape; the head stays asleep and the next request tries again.
"""

from __future__ import annotations

import asyncio

from ..errors import describe
from .errors import error_response

RESTING_PATHS = frozenset({"/health", "/status", "/metrics", "/props", "/models", "/v1/models"})
RETRY_AFTER_S = 5


class Wake:
    def __init__(self, app, head):
        self.app, self.head = app, head

    async def __call__(self, scope, receive, send):
        idle = getattr(self.head, "idle", None)  # set once the model has loaded, with --sleep-idle-seconds
        if (
            idle is None
            or scope["type"] != "http"
            or (scope["path"] in RESTING_PATHS and scope["method"] in ("GET", "HEAD"))
        ):
            return await self.app(scope, receive, send)
        holding = asyncio.ensure_future(asyncio.to_thread(idle.hold))
        try:
            await asyncio.shield(holding)
        except asyncio.CancelledError:  # the client left during the load: the hold it took ends too
            holding.add_done_callback(lambda f: f.cancelled() or f.exception() or idle.release())
            raise
        except Exception as e:
            message = f"the model could not be loaded again after sleeping: {describe(e)}"
            response = error_response(503, message, "unavailable_error", retry_after=RETRY_AFTER_S)
            return await response(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            idle.release()
