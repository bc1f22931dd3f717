"""What the OpenAI routes (api.py) and llama-server's native routes (llama_routes.py) share: the
common request fields and how they become engine parameters (sampling with the server's defaults,
stop strings, speculative override), prompts as text / token ids / llama-server's mixed lists, the
chat prompt, the bridge from an engine request to asyncio (`Run`), SSE framing and how a failed
generation is answered.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Union

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import MAX_CHOICES  # OpenAI's bound on `n`
from ..errors import Overloaded, Unavailable, UserError, describe
from .drain import ShuttingDown
from .errors import APIError
from .event_bridge import Inbox, LoopMailbox
from .gate import record_of

if TYPE_CHECKING:  # the engine's modules bring torch: imported when the model loads, after the port is up
    from ..serving.sampling import SamplingParams
    from ..serving.sequence import Event
    from ..serving.sequence import Request as EngineRequest
    from ..spec import SpecConfig
    from ..text.tool_calls import ToolFormat
    from ..text.tool_choice import ToolChoice
    from ..workers.head import HeadWorker as Head

DISCONNECT_POLL_S = 0.25
MAX_LOGPROBS = 20  # = sampling.MAX_LOGPROBS, which also checks it
LOADING_RETRY_S = 5
SEED_RANDOM = -1  # llama-server's "pick a seed": a random one per request

Stop = Union[str, list[str], None]
PROMPT_FORMS = (
    '"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt string, '
    "or a list of mixed strings & tokens."
)  # llama-server's words


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
    timings_per_token: bool = False  # llama-server: `timings` on every streamed chunk, not just the last
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
    from ..serving.sampling import SamplingParams

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


def usage_of(finals: list[Event]) -> dict | None:
    """One usage for all choices: the prompt once, every choice's completion tokens."""
    usages = [ev.usage for ev in finals if ev.usage]
    if not usages:
        return None
    completion = sum(u["completion_tokens"] for u in usages)
    return {**usages[0], "completion_tokens": completion, "total_tokens": usages[0]["prompt_tokens"] + completion}


def speculative_config(engine, body: CommonBody) -> SpecConfig | None:
    """The request's speculative override, validated against what this server can draft with."""
    over = {"speculative": body.speculative} if body.speculative is not None else {}
    for key in ("n_max", "n_min", "p_min"):
        if getattr(body, f"speculative_{key}") is not None:
            over[f"speculative.{key}"] = getattr(body, f"speculative_{key}")
    try:
        return engine.spec.request_config(over)
    except UserError as e:
        raise APIError(400, str(e), param="speculative") from None


def stop_list(stop: Stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stops) > 16:
        raise APIError(400, "at most 16 stop strings", param="stop")
    return stops


def check_token_ids(head: Head, ids: list[int], param: str = "prompt") -> list[int]:
    bad = next((t for t in ids if not 0 <= t < head.tok.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary of {head.tok.vocab_size}", param=param)
    return ids


def tokenize_mixed(head: Head, prompt, add_special: bool = True, parse_special: bool = True) -> list[int]:
    """llama-server's prompt forms in one: text, token ids, or a list mixing both (only the first
    element, if it is text, gets the BOS), or {"prompt_string": text}."""
    if isinstance(prompt, dict):
        if "multimodal_data" in prompt:
            raise APIError(
                400, "Multimodal data provided, but model does not support multimodal requests.", param="prompt"
            )
        if not isinstance(prompt.get("prompt_string"), str):
            raise APIError(400, "a prompt object must hold a prompt_string", param="prompt")
        prompt = prompt["prompt_string"]
    if isinstance(prompt, str):
        return head.tok.encode(prompt, add_special=add_special, parse_special=parse_special)
    if not isinstance(prompt, list):
        raise APIError(400, PROMPT_FORMS, param="prompt")
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += head.tok.encode(part, add_special=add_special and i == 0, parse_special=parse_special)
        elif isinstance(part, int) and not isinstance(part, bool):
            ids.append(part)
        else:
            raise APIError(400, PROMPT_FORMS, param="prompt")
    return check_token_ids(head, ids)


def split_prompts(prompt) -> list:
    """llama-server's rule: a list that holds no token id at its top level is a list of prompts;
    anything else is one prompt."""
    if isinstance(prompt, list) and prompt and not any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return prompt
    return [prompt]


async def chat_requests(
    head: Head, body: ChatBody, fit_context: bool = False
) -> tuple[str, list[EngineRequest], ToolFormat | None]:
    """A chat request's prompt text, its engine requests (one per choice) and the tool-call format
    its generations are parsed with (None: plain text); max_tokens defaults to the server's
    --n-predict, within the context. A max_tokens past the context is refused, or with
    `fit_context` cut to it (generation stops where the context ends, as llama-server's).
    `tool_choice: required` (or a named function) constrains generation to calls; auto constrains
    a call once its start marker is written (llama.cpp's lazy grammar)."""
    from ..serving.sequence import Request as EngineRequest

    engine = ready_engine(head)
    choice, fmt = await asyncio.to_thread(tool_plan, head, body)
    prompt = await asyncio.to_thread(template_prompt, head, body)
    ids = await asyncio.to_thread(head.tok.encode, prompt, add_special=True, parse_special=True)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    room = max(engine.n_ctx - len(ids), 0)
    if max_tokens is None:
        max_tokens = room if head.cfg.n_predict < 0 else min(head.cfg.n_predict, room)
    elif fit_context:
        max_tokens = min(max_tokens, room)
    engine.check(len(ids), max_tokens)
    n_top = (body.top_logprobs or 0) if body.logprobs else None
    req = EngineRequest(
        prompt=ids,
        params=sampling_params(head, body, n_top),
        max_tokens=max_tokens,
        stop=stop_list(body.stop),
        ignore_eos=body.ignore_eos,
        spec=speculative_config(engine, body),
        cache_prompt=body.cache_prompt,
        timings_per_token=body.timings_per_token,
        return_progress=body.stream and body.return_progress,
    )
    if fmt is not None and choice.parses:
        req.preserved_tokens = fmt.preserved(head.tok)
    if fmt is not None and choice.parses and grammar_fields(body) == [] and (choice.forces or fmt.triggers):
        # required: calls only; auto: once the model starts a call, it is held to the tools' schemas
        grammar = fmt.grammar(choice, head.tok, lazy=not choice.forces)
        return prompt, await choices(head, body, req, ("lark", grammar, "tools")), fmt
    return prompt, await choices(head, body, req), fmt if choice.parses else None


def tool_plan(head: Head, body: ChatBody) -> tuple[ToolChoice, ToolFormat | None]:
    """The request's checked tools and the chat template's tool-call format (None: the template
    writes no calls we can read)."""
    from ..text.tool_calls import ToolFormat
    from ..text.tool_choice import tool_choice_of

    choice = tool_choice_of(body.tools, body.tool_choice, body.parallel_tool_calls)
    if choice.parses and body.grammar is not None:  # llama-server's rule and words
        raise APIError(400, "Cannot use custom grammar constraints with tools.", param="grammar")
    return choice, ToolFormat.learn(head.chat_template) if choice.tools else None


# The chat prompt's own arguments (`chat_prompt`, `ChatTemplate.prompt`): chat_template_kwargs may not name them.
TEMPLATE_ARGUMENTS = frozenset({"head", "self", "messages", "add_generation_prompt", "continue_final_message"})


def template_prompt(head: Head, body) -> str:
    """The chat prompt of a body with `messages`, `add_generation_prompt`, `continue_final_message`,
    `tools` and `chat_template_kwargs` (a chat request, /apply-template, input_tokens)."""
    from ..text.tool_calls import ToolFormat, arguments_as_objects

    messages = [m.model_dump(exclude_none=True) if isinstance(m, BaseModel) else m for m in body.messages]
    fmt = (
        ToolFormat.learn(head.chat_template)
        if any(isinstance(m, dict) and m.get("tool_calls") for m in messages)
        else None
    )
    if fmt is not None and fmt.object_arguments:  # as llama.cpp: JSON-text arguments to templates that read objects
        messages = arguments_as_objects(messages)
    taken = sorted(TEMPLATE_ARGUMENTS & set(body.chat_template_kwargs or {}))
    if taken:  # the request's own fields (or our parameters): not template variables to override
        raise APIError(
            400,
            f"chat_template_kwargs must not set {', '.join(taken)}: the request's own fields say that",
            param=f"chat_template_kwargs.{taken[0]}",
        )
    extra = {**head.cfg.chat_template_kwargs, **(body.chat_template_kwargs or {})}
    if body.tools:
        extra["tools"] = body.tools
    from ..text.chat import ChatError

    try:
        return chat_prompt(head, messages, body.add_generation_prompt, body.continue_final_message, **extra)
    except ChatError as e:  # about the messages, or how they end (continue_final_message)
        field = "continue_final_message" if "continue_final_message" in str(e) else "messages"
        raise APIError(400, str(e), param=getattr(e, "param", None) or field) from None


def chat_prompt(
    head: Head,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool | None = None,
    **extra,
) -> str:
    """The chat prompt text (tokenize it with add_special=True, parse_special=True)."""
    return head.chat_template.prompt(messages, add_generation_prompt, continue_final_message, **extra)


def engine_share(n_slots: int) -> int:
    """Engine requests one HTTP request keeps in the engine at once (its choices, its embedding
    inputs): all slots but one, so another client always finds a slot within one of its turns, and
    one request never fills the queue."""
    return max(1, n_slots - 1)


class Run:
    """The engine requests of one HTTP request (one per choice) seen from asyncio: their events
    arrive in one inbox through the loop's `LoopMailbox`, tagged with the choice index. `streamed`:
    the response is an event stream, whose writes notice a client that left (starlette listens for
    it beside the stream, or a write fails): the disconnect poll then runs only while no events come.

    Fair admission: at most `engine_share` choices are in the engine at once; the rest are held here
    and submitted one as each of the request's own choices finishes (a full queue then holds it
    back until there is room: the request was admitted, it is not refused midway)."""

    def __init__(self, head: Head, http: Request, reqs: list[EngineRequest], streamed: bool = False):
        if head.cfg.role == "prefill":
            raise APIError(
                400, "this worker only prefills for decode heads (--role prefill): send requests to a decode head"
            )
        self.head, self.http, self.reqs, self.streamed = head, http, reqs, streamed
        self.record = record_of(http)
        self.inbox = Inbox()
        self.done: set[int] = set()  # choices whose final event the consumer has had
        self.ended = False  # aborted, or its consumer stopped reading
        mailbox = LoopMailbox.of(asyncio.get_running_loop())
        for i, req in enumerate(reqs):
            req.sink = lambda ev, i=i: mailbox.post(self.inbox, (i, ev))
        share = engine_share(head.engine.n_slots)
        self.held = list(reqs[share:])
        if not head.drain.admit(self):  # SIGTERM's drain has begun: ended before it starts, as a 503
            self.abort(ShuttingDown())  # (not raised: a stream may build its Run after its headers went out)
            return
        try:
            for req in reqs[:share]:
                head.engine.submit(req)
        except Exception:  # a full queue refuses the whole request, not some of its choices
            self._cancel()
            raise

    def _submit_held(self, n: int) -> None:
        """Up to `n` held choices into the engine; those a full queue refuses stay held (retried at
        the next poll)."""
        while n > 0 and self.held:
            try:
                self.head.engine.submit(self.held[0])
            except Overloaded:
                return
            self.held.pop(0)
            n -= 1

    def _in_engine(self, finished: int) -> int:
        return len(self.reqs) - len(self.held) - finished

    def _cancel(self) -> None:
        for req in self.reqs:
            self.head.engine.cancel(req)

    @property
    def live(self) -> bool:
        """Some choice still generating for a consumer (what SIGTERM's drain waits for)."""
        return not self.ended and len(self.done) < len(self.reqs)

    def abort(self, error: BaseException) -> None:
        """End every unfinished choice now (in the loop): the consumer reads a final event with
        `error` for each, as if the engine had failed it; the engine's own later events for them are
        dropped (`done`), their requests cancelled."""
        from ..serving.sequence import Event

        self.ended = True
        self.held.clear()
        for i in range(len(self.reqs)):
            if i not in self.done:
                self.inbox.put_nowait((i, Event(finish_reason="error", error=error)))
        self._cancel()

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) until every choice has finished; a client that goes away cancels
        them (their slots are freed at once)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        finals: list[Event] = []
        try:
            while len(finals) < len(self.reqs):
                if self.held:  # one in for each choice that finished (or was refused by a full queue)
                    self._submit_held(engine_share(self.head.engine.n_slots) - self._in_engine(len(finals)))
                i, ev = await self.inbox.get(DISCONNECT_POLL_S, empty=(0, None))
                # checked while events flow too: a non-streamed request's client may leave mid-generation
                if ev is None or (not self.streamed and loop.time() - checked >= DISCONNECT_POLL_S):
                    checked = loop.time()
                    if await self.http.is_disconnected():
                        return
                if ev is None or i in self.done:  # in `done`: an aborted choice's own late events
                    continue
                if ev.finish_reason is not None:
                    self.done.add(i)
                    finals.append(ev)
                    if self.record is not None:
                        self.record.usage(usage_of(finals))
                        if ev.error is not None:  # a stream has sent its 200 already: the log says why it ended
                            self.record.reason = describe(ev.error)
                yield i, ev
        finally:
            self.ended = True
            self._cancel()

    def response(self, parts: AsyncIterator[bytes]) -> StreamingResponse:
        """The event stream of `parts` (this run's SSE events), written once per burst."""
        return StreamingResponse(bursts(parts, self.inbox.pending), media_type="text/event-stream")


async def bursts(parts: AsyncIterator[bytes], pending: Callable[[], bool]) -> AsyncIterator[bytes]:
    """`parts` joined while `pending()` (more events already waiting): each write costs the ASGI
    middleware chain and a send, so a stream that falls behind catches up in fewer writes."""
    held: list[bytes] = []
    async for part in parts:
        held.append(part)
        if not pending():
            yield b"".join(held)
            held.clear()
    if held:
        yield b"".join(held)


def generation_error(ev: Event) -> APIError:
    """A failed generation by the type of its exception: a peer gone away (retry once it is back) is
    503, anything else 500."""
    message = f"generation failed: {describe(ev.error)}"
    if isinstance(ev.error, Unavailable):
        return APIError(503, message, "unavailable_error", retry_after=ev.error.retry_after)
    return APIError(500, message, "server_error")


def stream_error(ev: Event) -> dict:
    e = generation_error(ev)
    return {"error": {"message": describe(ev.error), "type": e.type, "param": None, "code": str(e.status)}}


async def single_reply(head: Head, http: Request, req: EngineRequest, calls: ToolFormat | None):
    """One request run to its end, not streamed: (content, tool calls, final event), None when the
    client left; a generation error raises (check_finish)."""
    from ..text.tool_calls import reply_parts

    text, final = [], None
    async for _, ev in Run(head, http, [req]).events():
        text.append(ev.text)
        if ev.finish_reason is not None:
            final = ev
    if final is None:
        return None
    check_finish(final)
    return (*reply_parts(calls, "".join(text)), final)


def check_finish(ev: Event) -> None:
    if ev.finish_reason == "error":
        raise generation_error(ev)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def named_sse(kind: str, data: dict) -> bytes:
    """An SSE event named by its type, as Anthropic's and OpenAI's Responses streams send them."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


def ready_engine(head: Head):
    if not head.ready:
        raise APIError(503, "Loading model", "unavailable_error", retry_after=LOADING_RETRY_S)
    return head.engine


def chat_body(chat: dict, body, keys: tuple[str, ...]) -> ChatBody:
    """A chat request translated from another API's `body`: `chat` plus the `keys` the body sets,
    validated as the chat route's own (400 naming the field)."""
    chat = {**chat, **{key: getattr(body, key) for key in keys if getattr(body, key) is not None}}
    try:
        return ChatBody.model_validate(chat)
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, err['loc']))}: {err['msg']}", param=str(err["loc"][0])) from None
