"""Vertex AI's custom-container predict route, as llama-server serves it when `AIP_MODE=PREDICTION`:
`POST <AIP_PREDICT_ROUTE>` (default /predict) with `{"instances": [...]}`; each instance names a
route by `@requestFormat` (the camelCase of its path without /v1: "chatCompletions", "completion",
"applyTemplate", ... or the path itself) and is that route's body. The instances run concurrently
through the app itself (its key check included, with the caller's headers), never streamed; the
answer is `{"predictions": [each route's JSON, or {"error": ...}]}` in order.
"""

from __future__ import annotations

import asyncio
import re

import httpx
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

MAX_INSTANCES = 128  # llama-server's bound
FORWARDED = ("authorization", "x-api-key")  # the caller's credentials, for the app's own key check


class PredictBody(BaseModel):
    instances: list = Field(..., max_length=MAX_INSTANCES)


def request_format(path: str) -> str:
    """llama-server's alias of a route: "/v1/chat/completions" -> "chatCompletions"."""
    parts = [p for p in re.split(r"[/_-]", path.removeprefix("/v1")) if p]
    return "".join(p if i == 0 else p[:1].upper() + p[1:] for i, p in enumerate(parts))


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": "instances", "code": 400}}


def add_predict_route(app: FastAPI, route: str) -> None:
    """Register the predict route over the POST routes the app has now (call it last), as its
    OpenAPI schema lists them (included routers too)."""
    paths: dict[str, str] = {}
    for path, ops in app.openapi()["paths"].items():
        if "post" in ops and "{" not in path:
            paths.setdefault(request_format(path), path)
            paths.setdefault(path, path)
    app.openapi_schema = None  # built again on request, with this route

    @app.post(route)
    async def predict(body: PredictBody, http: Request):
        headers = {k: v for k, v in http.headers.items() if k in FORWARDED}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://predict", timeout=None) as client:

            async def one(instance) -> object:
                if not isinstance(instance, dict):
                    return _error("each instance must be a JSON object")
                fmt = instance.get("@requestFormat")
                if not isinstance(fmt, str):
                    return _error("each instance must include a string @requestFormat")
                if fmt not in paths:
                    return _error(f"no handler registered for @requestFormat: {fmt}")
                payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
                if "stream" in payload:
                    payload["stream"] = False  # the predict route answers whole
                res = await client.post(paths[fmt], json=payload, headers=headers)
                try:
                    return res.json()
                except ValueError:
                    return res.text

            return {"predictions": await asyncio.gather(*(one(i) for i in body.instances))}
