"""Property-based fuzzing of every operation in the server's own /openapi.json: never a 5xx (but
llama-server's 501 for a feature this server or model does not offer), and every error in OpenAI's
shape (llama-server's exceed_context_size_error adds n_prompt_tokens and n_ctx)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from rpc_workers import head, running


@pytest.fixture(scope="module")
def api_schema(tiny_model, tmp_path_factory):
    with running(head(tiny_model("llama"), tmp_path_factory.mktemp("fuzz"), (), "--dtype", "float32")) as w:
        yield schemathesis.openapi.from_url(f"{w.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    response = case.call(timeout=60)
    # 501 not_supported_error: a feature this server was not started with (llama-server's answer)
    not_supported = response.status_code == 501 and response.json()["error"]["type"] == "not_supported_error"
    assert response.status_code < 500 or not_supported, (
        f"{case.method} {case.path} {case.body!r}: {response.text[:500]}"
    )
    if response.status_code >= 400:
        err = response.json()["error"]
        extra = {"n_prompt_tokens", "n_ctx"} if err.get("type") == "exceed_context_size_error" else set()
        assert set(err) == {"message", "type", "param", "code"} | extra and err["message"]
