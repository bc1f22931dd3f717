"""`http_gate.Gate` in front of a stub app, in process: a bug becomes a 500 in OpenAI's shape with
its traceback logged once; refusals log one line and no traceback; the key check is exact."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.testclient import TestClient

from hydra_console.engine.http.errors import error_response
from hydra_console.engine.http.gate import Gate, record_of

pytestmark = pytest.mark.unit


def client(api_key: str | None = None, max_body: int = 1024) -> TestClient:
    app = FastAPI()

    @app.exception_handler(HTTPException)  # as api.py's: the gate's 413 while streaming is raised in the route
    async def _http(_, e: HTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error")

    @app.post("/v1/echo")
    async def echo(request: Request):
        n = len(await request.body())
        record_of(request).usage({"prompt_tokens": 3, "completion_tokens": 4})
        return {"n": n}

    @app.get("/v1/bug")
    async def bug():
        raise RuntimeError("boom")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    app.add_middleware(Gate, api_key=api_key, max_body=max_body)
    return TestClient(app, raise_server_exceptions=False)


def test_a_bug_is_a_500_with_one_traceback(caplog):
    caplog.set_level(logging.INFO, "hydra.http")
    r = client().get("/v1/bug")
    assert (
        r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "boom" in r.json()["error"]["message"]
    )
    with_traceback = [rec for rec in caplog.records if rec.exc_info]
    assert len(with_traceback) == 1
    (line,) = [rec.getMessage() for rec in caplog.records if not rec.exc_info]
    assert line.startswith(r.headers["x-request-id"]) and " 500 " in line and "RuntimeError: boom" in line


def test_refusals_log_one_line_without_traceback(caplog):
    caplog.set_level(logging.INFO, "hydra.http")
    c = client(api_key="k", max_body=10)
    assert c.post("/v1/echo", content=b"x").status_code == 401
    assert c.post("/v1/echo", content=b"x" * 11, headers={"X-Api-Key": "k"}).status_code == 413
    chunked = c.post("/v1/echo", content=iter([b"x" * 6, b"x" * 6]), headers={"Authorization": "Bearer k"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    ok = c.post("/v1/echo", content=b"x" * 10, headers={"Authorization": "bearer k"})
    assert ok.json() == {"n": 10}
    assert c.get("/health").status_code == 200  # public, and not logged
    assert not any(rec.exc_info for rec in caplog.records)
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 4 and [ln.split()[3] for ln in lines] == ["401", "413", "413", "200"]
    assert "reason='Invalid API Key'" in lines[0] and "in=3 out=4" in lines[3]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer kk"}, {"Authorization": "Basic k"}, {"X-Api-Key": ""}, {"Authorization": "Bearer "}],
)
def test_wrong_or_missing_keys_are_401(headers):
    r = client(api_key="k").post("/v1/echo", content=b"", headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
