"""What the OpenAI routes (api.py) and llama-server's native routes (llama_routes.py) share: how
the common request fields (bodies.py) become engine parameters (sampling with the server's
defaults, logit bias, structured output, `n` choices, stop strings, speculative override), a chat
request's engine requests, and the ready engine. Prompts are prompts.py's; running the requests
and writing their events back, streaming.py's.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from ..serving.context_shift import UNLIMITED
from ..serving.sampling_params import SamplingParams
from .bodies import ChatBody, CommonBody, Stop, spec_override
from .errors import APIError
from .prompts import template_prompt, tool_plan

if TYPE_CHECKING:  # the engine's modules bring torch: imported when the model loads, after the port is up
    from ..serving.sequence import Request as EngineRequest
    from ..spec import SpecConfig
    from ..text.tool_calls import ToolFormat
    from .handle import Head

LOADING_RETRY_S = 5
SEED_RANDOM = -1  # llama-server's "pick a seed": a random one per request

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def sampling_params(head: Head, body: CommonBody, logprobs: int | None) -> SamplingParams:
    """The request's sampling: its own fields, else the server's defaults (`--temp`, `--seed`, ...).
    The seed is always fixed here (a random one when none is given) so that responses can report it."""

    given = {
        **head.cfg.sampling.given(),
        **{k: getattr(body, k) for k in SAMPLING_FIELDS if getattr(body, k) is not None},
    }
    if given.get("seed", SEED_RANDOM) == SEED_RANDOM:
        given["seed"] = secrets.randbits(32)
    bias = dict(logit_bias_pairs(head, body.logit_bias))
    if body.ignore_eos:  # as llama-server: the end-of-generation tokens are banned, not only passed over
        bias.update((t, float("-inf")) for t in sorted(head.tok.eog_ids))
    return SamplingParams(**given, logprobs=logprobs, logit_bias=tuple(bias.items()))


def logit_bias_pairs(head: Head, raw) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs from OpenAI's map or llama-server's pairs; a text key biases each of
    its tokens, `false` bans."""
    if not raw:
        return ()
    pairs = raw.items() if isinstance(raw, dict) else raw
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise APIError(400, f"logit_bias entries are [token, bias] pairs, got {pair!r}", param="logit_bias")
        key, bias = pair
        if bias is False:
            bias = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias or abs(bias) == float("inf"):
            raise APIError(
                400, f"logit_bias for {key!r} must be a finite number or false, got {bias!r}", param="logit_bias"
            )
        if isinstance(key, int) and not isinstance(key, bool) or isinstance(key, str) and key.lstrip("-").isdigit():
            ids = [int(key)]
        elif isinstance(key, str):
            ids = head.tok.encode(key, add_special=False, parse_special=False)
        else:
            raise APIError(400, f"logit_bias keys are token ids or text, got {key!r}", param="logit_bias")
        for t in ids:
            if not 0 <= t < head.tok.vocab_size:
                raise APIError(
                    400,
                    f"logit_bias token id {t} is outside the vocabulary of {head.tok.vocab_size}",
                    param="logit_bias",
                )
            out[t] = float(bias)
    return tuple(out.items())


def grammar_of(body: CommonBody) -> tuple[str, str] | None:
    """(the compiled llguidance grammar, the field it came from) of a structured-output request."""
    from ..text.structured import compile_grammar

    sources = grammar_fields(body)
    if len(sources) > 1:
        fields = ", ".join(f for _, _, f in sources)
        raise APIError(400, f"give one of response_format, json_schema and grammar, not {fields}", param=sources[1][2])
    if not sources:
        return None
    kind, source, field = sources[0]
    return compile_grammar(kind, source, field), field


def grammar_fields(body: CommonBody) -> list[tuple[str, Any, str]]:
    """(kind, source, field) of each structured-output field the request sets."""
    sources = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":  # llama-server also takes a schema here
            sources.append(("json_schema", rf.get("schema", {"type": "object"}), "response_format"))
        elif kind == "json_schema":
            wrapper = rf.get("json_schema")
            if not isinstance(wrapper, dict):
                raise APIError(
                    400, "response_format.json_schema must be an object holding `schema`", param="response_format"
                )
            sources.append(("json_schema", wrapper.get("schema", {}), "response_format"))
        elif kind != "text":
            raise APIError(
                400,
                f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                param="response_format",
            )
    if body.json_schema is not None:
        sources.append(("json_schema", body.json_schema, "json_schema"))
    if body.grammar is not None:
        sources.append(("gbnf", body.grammar, "grammar"))
    return sources


async def choices(
    head: Head, body: CommonBody, req: EngineRequest, grammar: tuple[str, str, str] | None = None
) -> list[EngineRequest]:
    """The engine requests of `body.n` choices: each its own grammar matcher (of the body's
    structured-output fields, or `grammar`: (kind, source, field)) and, when seeded, its own seed
    (seed + index), so seeded sampled choices differ and each one is reproducible."""
    from dataclasses import replace

    if body.n > head.cfg.max_n:
        raise APIError(
            400, f"n={body.n} choices are more than this server gives one request (--max-n {head.cfg.max_n})", param="n"
        )
    reqs = [req]
    for i in range(1, body.n):
        params = req.params if req.params.seed is None else replace(req.params, seed=(req.params.seed + i) % 2**64)
        reqs.append(replace(req, params=params))
    await constrain(head, body, reqs, grammar)
    return reqs


async def constrain(
    head: Head, body: CommonBody, reqs: list[EngineRequest], given: tuple[str, str, str] | None = None
) -> None:
    """Give each request its own matcher of the body's structured-output grammar (or of `given`:
    (kind, source, field)), if there is one."""
    from ..text.structured import compile_grammar

    if given is not None:
        grammar = await asyncio.to_thread(compile_grammar, *given), given[2]
    else:
        grammar = await asyncio.to_thread(grammar_of, body)
    if grammar is None:
        return
    # built on the model's llguidance tokenizer: the first one builds it (seconds)
    first = await asyncio.to_thread(head.engine.grammars.constraint, *grammar)
    for i, req in enumerate(reqs):
        req.constraint = first if i == 0 else first.copy()


def speculative_config(engine, body: CommonBody) -> SpecConfig | None:
    """The request's speculative override, validated against what this server can draft with."""
    over = {"speculative": body.speculative} if body.speculative is not None else {}
    for key in ("n_max", "n_min", "p_min"):
        if getattr(body, f"speculative_{key}") is not None:
            over[f"speculative.{key}"] = getattr(body, f"speculative_{key}")
    try:
        return engine.spec.request_config(spec_override(engine.spec.config, over))
    except UserError as e:
        raise APIError(400, str(e), param="speculative") from None


def pinned_slot(engine, body: CommonBody) -> int:
    """llama-server's id_slot: the slot the request must run in (it waits for it); -1: any."""
    if body.id_slot >= engine.n_slots:
        raise APIError(400, f"id_slot {body.id_slot} does not exist ({engine.n_slots} slots)", param="id_slot")
    return body.id_slot


def stop_list(stop: Stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stops) > 16:
        raise APIError(400, "at most 16 stop strings", param="stop")
    return stops


async def chat_requests(head: Head, body: ChatBody) -> tuple[list[EngineRequest], ToolFormat | None]:
    """A chat request's engine requests (one per choice) and the tool-call format
    its generations are parsed with (None: plain text); max_tokens defaults to the server's
    --n-predict (-1: unbounded). Past the context, generation stops where the slot is full
    ("length"), as llama-server's, or goes on with context shift.
    `tool_choice: required` (or a named function) constrains generation to calls; auto constrains
    a call once its start marker is written (llama.cpp's lazy grammar)."""
    from ..serving.sequence import Request as EngineRequest

    engine = ready_engine(head)
    choice, fmt = await asyncio.to_thread(tool_plan, head, body)
    prompt = await asyncio.to_thread(template_prompt, head, body)
    ids = await asyncio.to_thread(head.tok.encode, prompt, add_special=True, parse_special=True)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = UNLIMITED if head.cfg.n_predict < 0 else head.cfg.n_predict
    engine.check(len(ids), max_tokens)
    n_top = (body.top_logprobs or 0) if body.logprobs else None
    req = EngineRequest(
        prompt=ids,
        params=sampling_params(head, body, n_top),
        max_tokens=max_tokens,
        stop=stop_list(body.stop),
        ignore_eos=body.ignore_eos,
        spec=speculative_config(engine, body),
        id_slot=pinned_slot(engine, body),
        cache_prompt=body.cache_prompt,
        timings_per_token=body.timings_per_token,
        return_progress=body.stream and body.return_progress,
        n_keep=body.n_keep,
        n_discard=body.n_discard,
    )
    if fmt is not None and choice.parses:
        req.preserved_tokens = fmt.preserved(head.tok)
    if fmt is not None and choice.parses and grammar_fields(body) == [] and (choice.forces or fmt.triggers):
        # required: calls only; auto: once the model starts a call, it is held to the tools' schemas
        grammar = fmt.grammar(choice, head.tok, lazy=not choice.forces)
        return await choices(head, body, req, ("lark", grammar, "tools")), fmt
    return await choices(head, body, req), fmt if choice.parses else None


def ready_engine(head: Head):
    if not head.ready:
        raise APIError(503, "Loading model", "unavailable_error", retry_after=LOADING_RETRY_S)
    return head.engine


async def input_tokens(head: Head, chat) -> int:
    """The prompt tokens a body with `messages` would take (llama-server's token-counting routes: chat and
    Responses `input_tokens`, Anthropic's `count_tokens`)."""
    ready_engine(head)
    return await asyncio.to_thread(
        lambda: len(head.tok.encode(template_prompt(head, chat), add_special=True, parse_special=True))
    )
