"""The rerank routes (`--reranking`): llama-server's `/rerank`, `/reranking`, `/v1/rerank` and
`/v1/reranking`, over the same Engine that generates.

Each document becomes one query/document prompt (`model.rank.rerank_prompt`), run as an embedding
request (`embeddings.prompt_hidden_states`: a free slot each, at most `--parallel` - 1 of one request
in the engine at once); the reranker's classification head scores its last hidden state
(`model.rank.RankHead`).

Shapes, as llama-server (server-context.cpp `post_rerank`, server-common.cpp `format_response_rerank`):
- Jina / Cohere: `{query, documents, top_n?}` → `{model, object: "list", usage, results: [{index,
  relevance_score}]}`, best first, the first `top_n` (default all). `return_documents` (Jina's and
  Cohere's field, which llama-server ignores) adds each result's `document: {text}`.
- TEI (a body with `texts`): `{query, texts, return_text?}` → `[{index, score, text?}]`, best first;
  `top_n` applies too.
A document is a string, or an object with a `text` string (Jina's and Cohere v1's form).

Refused: without `--reranking` (or `--embedding` with pooling rank) 501 `not_supported_error`, as
llama-server; a model that is not a reranker 501 saying why (llama-server would answer the first
component of the last hidden state); a missing or non-string `query`, `documents` that are not a
non-empty array of texts, a `top_n` that is not a non-negative integer, a pair longer than a slot:
400 naming the field.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .common import ready_engine
from .embeddings import prompt_hidden_states
from .errors import APIError
from .limits import json_response

if TYPE_CHECKING:
    from .handle import Head

NOT_ENABLED = "This server does not support reranking. Start it with `--reranking`"


def _body(raw: Any) -> tuple[str, list[str], str, int, bool]:
    """(query, documents, the documents' field, top_n, whether texts come back) of a request body."""
    if not isinstance(raw, dict):
        raise APIError(400, "the body must be a JSON object")
    if "query" not in raw:
        raise APIError(400, '"query" must be provided', param="query")
    query = raw["query"]
    if not isinstance(query, str):
        raise APIError(400, '"query" must be a string', param="query")
    field = "texts" if "texts" in raw and "documents" not in raw else "documents"
    docs = raw.get(field)
    if not isinstance(docs, list) or not docs:
        raise APIError(400, f'"{field}" must be a non-empty string array', param=field)
    texts = []
    for doc in docs:
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise APIError(400, f'"{field}" must be a non-empty string array', param=field)
        texts.append(text)
    top_n = raw.get("top_n")
    if top_n is None:
        top_n = len(texts)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise APIError(400, f'"top_n" must be a non-negative integer, got {top_n!r}', param="top_n")
    give_text = "return_text" if "texts" in raw else "return_documents"
    returns = raw.get(give_text, False)
    if not isinstance(returns, bool):
        raise APIError(400, f'"{give_text}" must be a boolean', param=give_text)
    return query, texts, field, top_n, returns


def ranked(scores: list[float], texts: list[str], top_n: int, tei: bool, returns: bool) -> list[dict]:
    """The results, best first (ties in document order), the first `top_n`."""
    label = "score" if tei else "relevance_score"
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    out = []
    for i in order:
        item: dict[str, Any] = {"index": i, label: scores[i]}
        if returns:
            item.update({"text": texts[i]} if tei else {"document": {"text": texts[i]}})
        out.append(item)
    return out


def rerank_routes(head: Head) -> APIRouter:
    router = APIRouter()

    @router.post("/rerank")
    @router.post("/reranking", include_in_schema=False)  # llama-server's other names for it
    @router.post("/v1/rerank", include_in_schema=False)
    @router.post("/v1/reranking", include_in_schema=False)
    async def rerank(http: Request):
        from ..model.rank import rerank_prompt

        cfg = head.cfg
        if not cfg.embedding:
            raise APIError(501, NOT_ENABLED, "not_supported_error")
        engine = ready_engine(head)
        if head.pooling != "rank":
            raise APIError(501, f"{NOT_ENABLED} (pooling here is {head.pooling})", "not_supported_error")
        if head.rank_head is None:
            raise APIError(501, head.rank_refusal or NOT_ENABLED, "not_supported_error")
        try:
            raw = await http.json()
        except ValueError:
            raise APIError(400, "the body is not valid JSON") from None
        query, texts, field, top_n, returns = _body(raw)
        tei = "texts" in raw

        def prompts_of():
            prompts = [rerank_prompt(head.tok, head.gguf.metadata, query, t) for t in texts]
            for ids in prompts:
                if len(ids) > engine.n_ctx:
                    raise APIError(
                        400,
                        f"a query/document pair ({len(ids)} tokens) is too large to process: "
                        f"a slot holds {engine.n_ctx} tokens (--ctx)",
                        param=field,
                    )
            return prompts

        prompts = await asyncio.to_thread(prompts_of)
        hidden = await prompt_hidden_states(head, http, prompts)
        if hidden is None:
            return Response(status_code=499)  # the client left; nobody reads this
        n_tokens = sum(len(p) for p in prompts)

        def answer():
            scores = [head.rank_head.score(h) for h in hidden]
            results = ranked(scores, texts, top_n, tei, returns)
            if tei:
                return results
            return {
                "model": raw.get("model") or head.model_name,
                "object": "list",
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
                "results": results,
            }

        return await json_response(answer, cfg.max_response, field)

    return router
