"""The embedding routes (`--embedding`): OpenAI's `/v1/embeddings` and llama-server's `/embeddings`
and `/embedding`, over the same Engine that generates.

Each input becomes an engine request that runs its prompt only (`Request.embedding`): it takes a
free slot like any request, its prefill chunks share forwards with the other slots' work, and the
pipeline returns its final-norm hidden states (solo or split: whatever stage runs last).
`embedding` pools and normalises them. At most `--parallel` - 1 inputs of one request are in the
engine at once (`streaming.engine_share`: all slots but one, one of one), so a long list waits its turn
instead of filling the queue, and another client's request finds a slot meanwhile.

Shapes: `/v1/embeddings` answers OpenAI's list (`encoding_format` float or base64; a `content`
field instead of `input` answers llama-server's shape, as upstream does) and refuses pooling
`none`; `/embeddings` and `/embedding` answer `[{"index", "embedding": [[...], ...]}]`: one
normalised vector, or with pooling none every token's raw vector. Answers are bounded by
`--max-response` (http/limits.py): one that cannot fit is refused before anything is computed.
Pooling rank (a reranker) answers 501 here: its scores are /rerank's (http/rerank.py, which runs its
pairs through `prompt_hidden_states` too).
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .common import ready_engine
from .errors import APIError
from .gate import record_of
from .limits import check_embedding_size, json_response
from .streaming import Run, check_finish, engine_share

if TYPE_CHECKING:
    from .handle import Head


def _content_prompt(head: Head, entry: dict) -> list[int]:
    """OpenAI's content-parts input `{"content": [{"type": "text", "text": ...}, ...]}`: the texts joined."""
    parts = entry.get("content")
    if not isinstance(parts, list):
        raise APIError(400, '"content" must be an array of parts', param="input")
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                400, f"content part type {kind!r} is not supported: this model takes text parts only", param="input"
            )
    return head.tok.encode("".join(p["text"] for p in parts), add_special=True, parse_special=True)


def _tokenize_inputs(head: Head, value: Any, param: str, n_ctx: int) -> list[list[int]]:
    from .prompt_input import split_prompts, tokenize_prompt

    if not isinstance(value, (str, list, dict)):
        raise APIError(400, f'"{param}" must be a string, a list of token ids, or a list of those', param=param)
    prompts = [
        tokenize_prompt(p, head.tok, param, lambda e: _content_prompt(head, e)) for p in split_prompts(value, param)
    ]
    for ids in prompts:
        if not ids:
            raise APIError(400, "Input content cannot be empty", param=param)
        if len(ids) > n_ctx:
            raise APIError(
                400,
                f"input ({len(ids)} tokens) is too large to process: a slot holds {n_ctx} tokens (--ctx)",
                param=param,
            )
    return prompts


async def prompt_hidden_states(head: Head, http: Request, prompts: list[list[int]]):
    """Each prompt's final-norm hidden states [n, d], at most `engine_share` in the engine at once,
    the prompts' tokens counted on the request's access record; None when the client went away."""
    from ..serving.sequence import Request as EngineRequest

    turns = asyncio.Semaphore(engine_share(head.engine.n_slots))

    async def one(ids: list[int]):
        async with turns:
            run = Run(head, http, [EngineRequest(prompt=ids, max_tokens=0, cache_prompt=False, embedding=True)])
            final = None
            async for _, ev in run.events():
                final = ev
            if final is None:
                return None
            check_finish(final)
            return final.hidden

    tasks = [asyncio.ensure_future(one(ids)) for ids in prompts]
    try:
        hidden = await asyncio.gather(*tasks)
    finally:  # one input failed: the others are cancelled, and with them their engine requests
        for t in tasks:
            t.cancel()
    if any(h is None for h in hidden):
        return None
    record = record_of(http)
    if record is not None:
        record.tokens_in, record.tokens_out = sum(len(p) for p in prompts), 0
    return hidden


def embedding_routes(head: Head) -> APIRouter:
    router = APIRouter()

    async def handle(http: Request, oai: bool):
        from ..embedding import embed_vectors

        cfg = head.cfg
        if not cfg.embedding:
            raise APIError(
                501, "This server does not support embeddings. Start it with `--embeddings`", "not_supported_error"
            )
        engine = ready_engine(head)
        if head.pooling == "rank":  # llama-server reads past the scores it pools here
            raise APIError(
                501,
                "This server ranks (pooling rank: --reranking or the model's own): POST /rerank; "
                "embeddings need --pooling mean, cls, last or none",
                "not_supported_error",
            )
        if oai and head.pooling == "none":
            raise APIError(
                400,
                "Pooling type 'none' is not OAI compatible. Please use a different pooling type "
                "(--pooling mean, cls or last)",
                param="pooling",
            )
        try:
            body = await http.json()
        except ValueError:
            raise APIError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        if "input" in body:
            value, param = body["input"], "input"
        elif "content" in body:
            value, param, oai = body["content"], "content", False  # llama-server's field: its own shape
        else:
            raise APIError(400, '"input" or "content" must be provided', param="input")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise APIError(
                400, "The format to return the embeddings in. Can be either float or base64", param="encoding_format"
            )
        norm = body.get("embd_normalize", cfg.embd_normalize)
        if not isinstance(norm, int) or isinstance(norm, bool):
            raise APIError(400, f"embd_normalize must be an integer, got {norm!r}", param="embd_normalize")
        prompts = await asyncio.to_thread(_tokenize_inputs, head, value, param, engine.n_ctx)
        vectors_per_token = head.pooling == "none"  # every token's vector, else one per input
        n_vectors = sum(len(p) for p in prompts) if vectors_per_token else len(prompts)
        n_embd = head.pipeline.local.cfg.n_embd
        check_embedding_size(n_vectors * n_embd, oai and fmt == "base64", cfg.max_response, param)
        hidden = await prompt_hidden_states(head, http, prompts)
        if hidden is None:
            return Response(status_code=499)  # the client left; nobody reads this
        n_tokens = sum(len(p) for p in prompts)

        def answer():  # in a thread: pooling, lists of floats and their JSON never hold the event loop
            vectors = [embed_vectors(h, head.pooling, norm) for h in hidden]
            if not oai:
                return [{"index": i, "embedding": [v.tolist() for v in vs]} for i, vs in enumerate(vectors)]
            data = []
            for i, (v,) in enumerate(vectors):
                if fmt == "base64":  # little-endian float32, as OpenAI and llama-server encode it
                    data.append(
                        {
                            "embedding": base64.b64encode(v.numpy().astype("<f4").tobytes()).decode(),
                            "index": i,
                            "object": "embedding",
                            "encoding_format": "base64",
                        }
                    )
                else:
                    data.append({"embedding": v.tolist(), "index": i, "object": "embedding"})
            return {
                "model": body.get("model") or head.model_name,
                "object": "list",
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
                "data": data,
            }

        return await json_response(answer, cfg.max_response, param)

    @router.post("/v1/embeddings")
    async def embeddings_oai(http: Request):
        return await handle(http, oai=True)

    @router.post("/embeddings")
    @router.post("/embedding", include_in_schema=False)  # llama-server's legacy name
    async def embeddings(http: Request):
        return await handle(http, oai=False)

    return router
