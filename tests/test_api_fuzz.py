"""Fuzzing every route of a head that serves them all (`--embedding`, `--slot-save-path`): never a
5xx (but llama-server's 501 for a feature this server or model does not offer), and every error in
OpenAI's shape (llama-server's exceed_context_size_error adds n_prompt_tokens and n_ctx).

- property-based, from the server's own /openapi.json (schemathesis, a few examples per operation);
- a sweep that puts each of a few wrong values into each field of each route's body, beside an
  otherwise good request, and expects a 4xx that names the field when it is a 400
  (`chat_template_kwargs` carrying the request's own fields included);
- /slots' path, query and file names."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from rpc_workers import HTTP, head, running

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def api_server(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    argv = ("--dtype", "float32", "--embedding", "--slot-save-path", str(logs), "--n-predict", "4")
    with running(head(tiny_model("llama"), logs, (), *argv, ctx=128)) as w:  # a short context: quick to fill
        yield w


@pytest.fixture(scope="module")
def api_schema(api_server):
    return schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def check(status: int, body: bytes, what: str) -> dict | None:
    """No 5xx but a 501 not_supported_error; an error in OpenAI's shape. The error, if any."""
    if status < 400:
        return None
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"{what}: {status} not in OpenAI's shape: {body[:300]!r}") from None
    not_supported = status == 501 and err.get("type") == "not_supported_error"
    assert status < 500 or not_supported, f"{what}: {status} {body[:500]!r}"
    extra = {"n_prompt_tokens", "n_ctx"} if err.get("type") == "exceed_context_size_error" else set()
    assert set(err) == {"message", "type", "param", "code"} | extra and err["message"], f"{what}: {err}"
    return err


@schema.parametrize()
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    response = case.call(timeout=TIMEOUT)
    check(response.status_code, response.content, f"{case.method} {case.path} {case.body!r}")


HI = [{"role": "user", "content": "hi"}]
# A good body per route: the wrong value goes in beside it, so the request gets past the fields it needs.
GOOD = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/completion": {"prompt": "hi", "n_predict": 1},
    "/completions": {"prompt": "hi", "n_predict": 1},
    "/infill": {"input_prefix": "a", "input_suffix": "b", "n_predict": 1},
    "/apply-template": {"messages": HI},
    "/chat/completions/input_tokens": {"messages": HI},
    "/v1/chat/completions/input_tokens": {"messages": HI},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/messages": {"model": "m", "max_tokens": 1, "messages": HI},
    "/v1/messages/count_tokens": {"model": "m", "messages": HI},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/responses/input_tokens": {"input": "hi"},
    "/v1/embeddings": {"input": "hi"},
    "/embeddings": {"input": "hi"},
    "/embedding": {"input": "hi"},
}
EMBEDDING_FIELDS = ("input", "content", "encoding_format", "embd_normalize", "model")  # read from the raw body
WRONG = (None, "x", -1, 10**30, {"messages": HI, "add_generation_prompt": False, "head": 1})
NOT_BODIES = (b"not json", b"[]", b'"x"', b"null", b"{}")


def _fields(spec: dict, op: dict) -> set[str]:
    """The top-level fields of an operation's JSON body schema."""
    schemas = spec.get("components", {}).get("schemas", {})
    out: set[str] = set()

    def walk(s: dict) -> None:
        if "$ref" in s:
            return walk(schemas[s["$ref"].rsplit("/", 1)[-1]])
        for key in ("anyOf", "allOf", "oneOf"):
            for sub in s.get(key, []):
                walk(sub)
        out.update(s.get("properties", {}))

    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body is not None:
        walk(body)
    return out


def test_a_wrong_value_in_any_field_of_any_route_is_a_4xx_naming_it(api_server):
    spec = HTTP.get(f"{api_server.url}/openapi.json", timeout=TIMEOUT).json()
    posts = {path for path, ops in spec["paths"].items() if "post" in ops and "{" not in path} | set(GOOD)
    cases: list[tuple[str, bytes, str | None]] = []
    for path in sorted(posts):
        op = spec["paths"].get(path, {}).get("post", {})
        fields = _fields(spec, op) or (set(EMBEDDING_FIELDS) if "embedding" in path else set())
        good = GOOD.get(path, {})
        cases += [(path, raw, None) for raw in NOT_BODIES]
        for f in sorted(fields):  # two wrong values per field, in turn: the routes' shared fields see them all
            turn = len(cases)
            values = (
                [WRONG[turn % len(WRONG)], WRONG[(turn + 2) % len(WRONG)]] if f != "chat_template_kwargs" else WRONG
            )
            cases += [(path, json.dumps({**good, f: v}).encode(), f) for v in values]
    assert {"/v1/chat/completions", "/embeddings", "/apply-template", "/infill"} <= posts

    def send(case):
        path, raw, field = case
        r = HTTP.post(
            f"{api_server.url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=TIMEOUT
        )
        return case, r.status_code, r.content

    unnamed = []
    with ThreadPoolExecutor(4) as pool:  # below the slots + queue: no 503 for load
        for (path, raw, field), status, body in pool.map(send, cases):
            err = check(status, body, f"POST {path} {raw[:200]!r}")
            if err is not None and status == 400 and field is not None and not err["param"]:
                unnamed.append(f"POST {path} {raw[:120]!r}: {err['message'][:120]}")
    assert not unnamed, "\n".join(unnamed[:20])
    print(f"{len(cases)} bodies over {len(posts)} routes")


def test_chat_template_kwargs_naming_the_requests_own_fields_are_400(api_server):
    for path, good in (("/v1/chat/completions", GOOD["/v1/chat/completions"]), ("/apply-template", {"messages": HI})):
        for key, value in (("messages", HI), ("add_generation_prompt", False), ("continue_final_message", True)):
            r = HTTP.post(
                f"{api_server.url}{path}", json={**good, "chat_template_kwargs": {key: value}}, timeout=TIMEOUT
            )
            err = check(r.status_code, r.content, f"{path} chat_template_kwargs.{key}")
            assert r.status_code == 400 and err["param"] == f"chat_template_kwargs.{key}", (path, key, err)


def test_slots_path_query_and_names_are_4xx(api_server):
    url = api_server.url
    for slot in ("-1", "2", "99999999999999999999", "x"):
        for action in ("save", "restore", "erase", "nope"):
            r = HTTP.post(f"{url}/slots/{slot}", params={"action": action}, json={"filename": "a.bin"}, timeout=TIMEOUT)
            err = check(r.status_code, r.content, f"/slots/{slot}?action={action}")
            assert err is not None and r.status_code in (400, 422), (slot, action, err)
    for name in ("a\x00b", "x" * 300, ".", "..", "", "a/b", "\\x", 5, None, ["a"]):
        for action in ("save", "restore"):
            r = HTTP.post(f"{url}/slots/0", params={"action": action}, json={"filename": name}, timeout=TIMEOUT)
            err = check(r.status_code, r.content, f"/slots/0?action={action} {name!r}")
            assert r.status_code == 400 and err["param"] == "filename", (name, action, err)
    r = HTTP.post(f"{url}/slots/0", params={"action": "save"}, content=b"{", timeout=TIMEOUT)
    check(r.status_code, r.content, "/slots/0 bad JSON")
