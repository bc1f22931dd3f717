"""llama-server's native endpoints, with its request and response shapes: /completion (and
/completions), /infill, /props, /apply-template, /chat/completions/input_tokens, /tokenize and
/detokenize. The OpenAI routes are api.py's; what both need is api_common's; /completion's and
/infill's bodies and answers are llama_completion.py's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from ..serving.sampling_params import SamplingParams
from .bodies import sampler_fields
from .common import input_tokens, ready_engine
from .errors import APIError
from .llama_completion import OFF_SAMPLERS, SAMPLERS, InfillBody, NativeCompletionBody, infill_prompt, respond
from .prompts import check_token_ids, split_prompts, template_prompt, tokenize_mixed

if TYPE_CHECKING:
    from .handle import Head

BUILD_INFO = "b0-hydra-0.1.0"  # llama-server's build_info / system_fingerprint ("b" + build number)


class TemplateBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    messages: list[Any]
    add_generation_prompt: bool = True
    continue_final_message: bool | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeBody(BaseModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(BaseModel):
    tokens: list[int]


def _tokenize(head: Head, body: TokenizeBody) -> dict:
    ids = head.tok.encode(body.content, add_special=body.add_special, parse_special=body.parse_special)
    if not body.with_pieces:
        return {"tokens": ids}
    pieces = []
    for t in ids:
        raw = head.tok.token_bytes(t)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return {"tokens": pieces}


def props(head: Head) -> dict:
    """GET /props: what llama-server's web UI and clients read (context, template, modalities, ...)."""
    ready = head.status.startup_stage >= 2
    engine = head.engine
    defaults = sampling_params_defaults(head) if ready else {}
    model = head.status.model
    return {
        "default_generation_settings": {"params": defaults, "n_ctx": head.cfg.model.ctx},
        "total_slots": head.cfg.parallel,
        "model_alias": head.model_name,
        "model_path": model.path if model is not None else None,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "chat_template": head.chat_template.source if ready else "",
        "bos_token": head.tok.token_text(head.tok.bos_id) if ready and head.tok.bos_id is not None else "",
        "eos_token": head.tok.token_text(head.tok.eos_id) if ready and head.tok.eos_id is not None else "",
        "build_info": BUILD_INFO,
        "is_sleeping": head.status.sleeping,
        "n_ctx": engine.n_ctx if engine is not None else head.cfg.model.ctx,
    }


def sampling_params_defaults(head: Head) -> dict:
    p = SamplingParams(**head.cfg.sampling.given())
    n = head.cfg.n_predict
    return {
        "seed": -1 if p.seed is None else p.seed,
        **sampler_fields(p),
        **OFF_SAMPLERS,
        "max_tokens": n,
        "n_predict": n,
        "n_keep": head.cfg.n_keep,
        "n_discard": 0,
        "samplers": list(SAMPLERS),
    }


def router(head: Head) -> APIRouter:
    r = APIRouter()

    @r.get("/props")
    async def get_props():
        return props(head)

    @r.post("/props")
    async def post_props():
        raise APIError(
            501,
            "This server does not support changing global properties. Start it with `--props`",
            "not_supported_error",
        )

    @r.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        ready_engine(head)
        return await asyncio.to_thread(_tokenize, head, body)

    @r.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        ready_engine(head)
        check_token_ids(head, body.tokens, "tokens")
        return {"content": await asyncio.to_thread(head.tok.decode, body.tokens)}

    @r.post("/apply-template")
    async def apply_template(body: TemplateBody):
        ready_engine(head)
        return {"prompt": await asyncio.to_thread(template_prompt, head, body)}

    @r.post("/chat/completions/input_tokens")
    @r.post("/v1/chat/completions/input_tokens")
    async def chat_input_tokens(body: TemplateBody):
        return {"object": "response.input_tokens", "input_tokens": await input_tokens(head, body)}

    @r.post("/completion")
    @r.post("/completions")
    async def completion(body: NativeCompletionBody, http: Request):
        ready_engine(head)
        prompts = split_prompts(body.prompt)
        ids = [await asyncio.to_thread(tokenize_mixed, head, p) for p in prompts]
        return await respond(head, http, body, ids)

    @r.post("/infill")
    async def infill(body: InfillBody, http: Request):
        ready_engine(head)
        ids = await asyncio.to_thread(infill_prompt, head, body)
        return await respond(head, http, body, [ids])

    return r
