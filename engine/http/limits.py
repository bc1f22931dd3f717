"""Bounded responses (`--max-response`): no response body the head builds is larger than the limit;
beyond it the request is answered 400 in OpenAI's shape, naming the limit.

- Every JSON a route returns is rendered by `capped_json(limit)`, the app's default response class:
  the net under every route.
- The routes whose answers grow with the request (completions with `n` and logprobs, embeddings)
  build their bytes with `json_response`, in a thread: a large body never stalls the event loop.
- Embeddings are refused before any is computed when even the smallest JSON of their values
  (`MIN_FLOAT_JSON` bytes each) would pass the limit: `check_embedding_size`.

Streamed responses (SSE) are not counted here: their size is bounded by the tokens they stream
(`max_tokens` × the request's choices)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response

from .errors import APIError

# The fewest bytes a float takes in our JSON ("0.0" and a ","), and in base64 (4 bytes as 4/3 chars).
MIN_FLOAT_JSON = 4
MIN_FLOAT_BASE64 = 16 / 3


def too_large(size: int | str, limit: int, param: str | None = None) -> APIError:
    return APIError(
        400,
        f"the response would be {size} bytes, more than --max-response ({limit} bytes): ask for less",
        param=param,
        code="response_too_large",
    )


def dumps(obj: Any, limit: int, param: str | None = None) -> bytes:
    """`obj` as compact JSON (as starlette's JSONResponse writes it; what JSON has no type for, as
    FastAPI encodes it), refused beyond `limit` bytes."""
    body = json.dumps(
        obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"), default=jsonable_encoder
    ).encode()
    if len(body) > limit:
        raise too_large(len(body), limit, param)
    return body


async def json_response(build, limit: int, param: str | None = None, status: int = 200) -> Response:
    """The JSON of `build()` (an object, or a function that makes one: it runs in the thread too),
    made in a thread, refused beyond `limit` bytes."""
    body = await asyncio.to_thread(lambda: dumps(build() if callable(build) else build, limit, param))
    return Response(body, status_code=status, media_type="application/json")


def capped_json(limit: int) -> type[JSONResponse]:
    """The app's default response class: JSONResponse refusing bodies beyond `limit` bytes."""

    class CappedJSONResponse(JSONResponse):
        def render(self, content: Any) -> bytes:
            return dumps(content, limit)

    return CappedJSONResponse


def check_embedding_size(n_values: int, base64: bool, limit: int, param: str) -> None:
    """Refuse, before computing them, embeddings whose answer cannot fit `limit`: `n_values` floats
    take at least MIN_FLOAT_JSON bytes each (MIN_FLOAT_BASE64 in base64)."""
    least = int(n_values * (MIN_FLOAT_BASE64 if base64 else MIN_FLOAT_JSON))
    if least > limit:
        raise too_large(f"at least {least}", limit, param)
