"""The generation request bodies both APIs parse (pydantic): `CommonBody` (the fields every
generation request may carry, OpenAI's and llama-server's names), `ChatBody` (a chat request), and
`chat_body`, another API's request translated into a `ChatBody`; `spec_override`, a request's
speculative fields over the server's `SpecConfig`; `sampler_fields`, the settings of a request's
samplers as llama-server reports them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import MAX_CHOICES, SpecConfig  # MAX_CHOICES: OpenAI's bound on `n`
from ..errors import UserError
from ..serving.sampling_params import MAX_LOGPROBS, SamplingParams  # MAX_LOGPROBS: the bound the params check
from .errors import APIError

Stop = Union[str, list[str], None]


class CommonBody(BaseModel):
    """Fields every generation request may carry (OpenAI's and llama-server's names)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, lt=2**31)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=100.0)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Stop = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True  # llama-server: reuse the KV of a prefix a slot already holds
    id_slot: int = Field(-1, ge=-1)  # llama-server: run in this slot, waiting for it (-1: the best free one)
    timings_per_token: bool = False  # llama-server: `timings` on every streamed chunk, not just the last
    # llama-server's context shift (--context-shift): prompt tokens kept after the BOS (-1: all; absent:
    # the server's --keep) and tokens dropped after them (0: half of the rest)
    n_keep: int | None = Field(None, ge=-1)
    n_discard: int = Field(0, ge=0)
    return_progress: bool = False  # llama-server: streamed `prompt_progress` chunks while the prompt is computed
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices: one engine request each")
    # OpenAI's {"token id": bias}; llama-server's [[id or text, bias]] too; a bias of false bans the token
    logit_bias: Union[dict[str, Any], list[Any], None] = None  # checked by logit_bias_pairs
    # Structured output (engine/structured.py): at most one of these
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None  # llama-server
    grammar: str | None = None  # llama-server: GBNF (or Lark)
    # Speculative decoding for this request: {"type": "off"|"ngram"|"draft", "n_max", "n_min", "p_min"},
    # or llama-server's flat fields; checked against the server's drafters by the engine's Speculator.
    speculative: Union[bool, dict[str, Any], None] = None
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", ge=0)
    speculative_n_min: int | None = Field(None, alias="speculative.n_min", ge=0)
    speculative_p_min: float | None = Field(None, alias="speculative.p_min", ge=0.0, le=1.0)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatBody(CommonBody):
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool | None = None  # None: a last assistant message is continued (prefill)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None  # none / auto / required / {"function": {"name"}}
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    verbose: bool = False  # llama-server: `__verbose` (the prompt) in the response
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False


def chat_body(chat: dict, body, keys: tuple[str, ...]) -> ChatBody:
    """A chat request translated from another API's `body`: `chat` plus the `keys` the body sets,
    validated as the chat route's own (400 naming the field)."""
    chat = {**chat, **{key: getattr(body, key) for key in keys if getattr(body, key) is not None}}
    try:
        return ChatBody.model_validate(chat)
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, err['loc']))}: {err['msg']}", param=str(err["loc"][0])) from None


def spec_override(base: SpecConfig, body: dict) -> SpecConfig:
    """A request's speculative override over the server's `base` (`base` itself when the body has
    none): `speculative: {type, n_max, n_min, p_min, adaptive}` (or a bool) or llama-server's flat
    `speculative.n_max` / `speculative.n_min` / `speculative.p_min`. Bad fields are a UserError."""
    over: dict = {}
    nested = body.get("speculative")
    if nested is not None:
        if isinstance(nested, bool):
            nested = {"type": base.type if nested and base.type != "off" else ("ngram" if nested else "off")}
        if not isinstance(nested, dict):
            raise UserError('\'speculative\' must be an object like {"type": "ngram", "n_max": 4}')
        unknown = set(nested) - {"type", "n_max", "n_min", "p_min", "adaptive"}
        if unknown:
            raise UserError(f"unknown 'speculative' field(s): {', '.join(sorted(unknown))}")
        over.update(nested)
    for key in ("n_max", "n_min", "p_min"):
        if f"speculative.{key}" in body:
            over[key] = body[f"speculative.{key}"]
    if not over:
        return base
    for key in ("n_max", "n_min"):
        if key in over and (isinstance(over[key], bool) or not isinstance(over[key], int)):
            raise UserError(f"speculative {key} must be an integer, got {over[key]!r}")
    if "n_max" in over and "n_min" not in over:
        over["n_min"] = min(base.n_min, over["n_max"])
    return replace(base, **over)


def sampler_fields(p: SamplingParams) -> dict:
    """The sampler settings of `p` under llama-server's names: what /slots' `params`, /props'
    defaults and /completion's `generation_settings` report."""
    return {
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
    }
