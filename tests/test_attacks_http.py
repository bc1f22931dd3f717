"""The head's HTTP surface under abuse (issue 13, HTTP part), against real `hydra-engine serve`
processes: body limit, a big prompt tokenizing while /health answers, queue full → 503 +
Retry-After with no request lost, chat's default max_tokens, the API key, /health 503 with a peer
killed, and the log (one line per failed request, no traceback for a 4xx).

Assertions are about behaviour, never speed: every deadline is generous."""

from __future__ import annotations

import json
import random
import socket
import threading

import httpx
import pytest
from rpc_workers import head, peer, running, wait_for

pytestmark = pytest.mark.integration

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 4 << 20
N_PREDICT = 5
MAX_QUEUE = 1
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    w = head(
        tiny_model("llama"),
        tmp_path_factory.mktemp("attacks-http"),
        (),
        "--dtype",
        "float32",
        "--api-key",
        KEY,
        "--max-body",
        str(MAX_BODY),
        "--max-queue",
        str(MAX_QUEUE),
        "--n-predict",
        str(N_PREDICT),
        parallel=1,
    )
    with running(w) as w:
        yield w


def post(w, path: str, body: dict, headers=AUTH, timeout: float = TIMEOUT) -> httpx.Response:
    return httpx.post(f"{w.url}{path}", json=body, headers=headers, timeout=timeout)


def raw_request(w, head_lines: list[str], chunks) -> bytes:
    """Send a request's header and then `chunks` over a plain socket; the response (header and
    Content-Length body). Sending stops quietly when the server has answered and closed early."""
    with socket.create_connection(("127.0.0.1", w.port), timeout=TIMEOUT) as s:
        s.sendall(("\r\n".join(head_lines) + "\r\n\r\n").encode())
        try:
            for c in chunks:
                s.sendall(c)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        while b"\r\n\r\n" not in out or len(out) < _response_length(out):
            data = s.recv(65536)
            assert data, f"connection closed mid-response: {out[:200]!r}"
            out += data
        return out


def _response_length(raw: bytes) -> int:
    header, _, _ = raw.partition(b"\r\n\r\n")
    length = next(int(ln.split(b":")[1]) for ln in header.split(b"\r\n") if ln.lower().startswith(b"content-length:"))
    return len(header) + 4 + length


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


# ---- body limit -----------------------------------------------------------------------------------


def test_oversize_content_length_is_413_before_the_body_is_read(server):
    lines = [
        "POST /v1/completions HTTP/1.1",
        f"Host: 127.0.0.1:{server.port}",
        f"Authorization: Bearer {KEY}",
        "Content-Type: application/json",
        f"Content-Length: {MAX_BODY + 1}",
    ]
    reply = raw_request(server, lines, [b'{"prompt": "'])  # the rest never comes: the header alone decides
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"request_too_large"' in reply and b"--max-body" in reply


def test_oversize_chunked_body_is_413_while_it_streams(server):
    lines = [
        "POST /v1/completions HTTP/1.1",
        f"Host: 127.0.0.1:{server.port}",
        f"Authorization: Bearer {KEY}",
        "Content-Type: application/json",
        "Transfer-Encoding: chunked",
    ]
    piece = 1 << 20
    chunks = [b'%x\r\n{"prompt": "%s\r\n' % (piece, b"a" * (piece - 12))]
    chunks += [b"%x\r\n%s\r\n" % (piece, b"a" * piece)] * (MAX_BODY // piece)  # past the limit, never finished
    reply = raw_request(server, lines, chunks)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"request_too_large"' in reply


# ---- a big prompt tokenizes off the event loop ------------------------------------------------------


def test_health_answers_while_a_big_prompt_tokenizes(server):
    # CJK text: each character is a byte-fallback token or three, the slow path of the tokenizer.
    rng = random.Random(0)
    prompt = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(MAX_BODY // 3 - 1000))
    done = threading.Event()
    result = {}

    def big():
        body = json.dumps({"prompt": prompt, "max_tokens": 1}, ensure_ascii=False).encode()
        result["r"] = httpx.post(
            f"{server.url}/v1/completions",
            content=body,
            timeout=TIMEOUT,
            headers={**AUTH, "Content-Type": "application/json"},
        )
        done.set()

    t = threading.Thread(target=big)
    t.start()
    answered_during = 0
    while not done.is_set():
        r = httpx.get(f"{server.url}/health", timeout=TIMEOUT)
        assert r.status_code == 200
        answered_during += not done.is_set()
    t.join(TIMEOUT)
    # A blocked loop answers at most the one /health that was waiting when the tokenizer finished.
    print(f"{answered_during} /health answers while the big prompt was in flight")
    assert answered_during >= 3, answered_during
    assert_openai_error(result["r"], 400)  # far longer than the context: refused after tokenizing


# ---- the queue bound ----------------------------------------------------------------------------------


def test_a_burst_beyond_the_queue_gets_503_with_retry_after_and_none_is_lost(server):
    n = 8  # one slot + MAX_QUEUE waiting: the rest of the burst is shed
    results: list[httpx.Response | BaseException] = [None] * n

    def one(i):
        try:
            results[i] = post(
                server,
                "/v1/completions",
                {"prompt": f"request {i}", "max_tokens": 200, "ignore_eos": True, "temperature": 0},
            )
        except BaseException as e:  # a hang or a dropped connection: reported below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 10)
    assert all(isinstance(r, httpx.Response) for r in results), results
    codes = sorted(r.status_code for r in results)
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    for r in results:
        if r.status_code == 503:
            assert_openai_error(r, 503, "server_overloaded")
            assert int(r.headers["Retry-After"]) >= 1
        else:
            assert r.json()["usage"]["completion_tokens"] == 200
    metrics = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    assert "llamacpp:requests_deferred" in metrics and "hydra_requests_rejected_total" in metrics


# ---- chat's default max_tokens ---------------------------------------------------------------------------


def test_chat_without_max_tokens_stops_at_the_server_default(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == N_PREDICT and body["choices"][0]["finish_reason"] == "length"


# ---- the API key ----------------------------------------------------------------------------------------


def test_api_key_is_required_on_the_api_not_on_observation_routes(server):
    body = {"prompt": "hi", "max_tokens": 1}
    assert_openai_error(post(server, "/v1/completions", body, headers={}), 401, "invalid_api_key")
    assert_openai_error(post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(post(server, "/v1/completions", body, headers={"X-Api-Key": KEY[:-1]}), 401)
    assert httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).status_code == 401
    assert post(server, "/v1/completions", body).status_code == 200
    assert post(server, "/v1/completions", body, headers={"X-Api-Key": KEY}).status_code == 200
    for path in ("/health", "/status", "/metrics"):
        assert httpx.get(f"{server.url}{path}", timeout=TIMEOUT).status_code == 200, path


# ---- the log ----------------------------------------------------------------------------------------------


def test_one_log_line_per_failed_request_and_no_traceback_for_a_4xx(server):
    failed = [
        post(server, "/v1/completions", {"prompt": "hi"}, headers={}),  # 401
        post(server, "/v1/completions", {"prompt": "hi", "temperature": -1}),  # 400
        post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 10_000}),  # 400: beyond the context
    ]
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert [r.status_code for r in failed] == [401, 400, 400] and ok.status_code == 200

    def lines_of(r):
        return [
            ln for ln in server.log_path.read_text(errors="replace").splitlines() if r.headers["x-request-id"] in ln
        ]

    wait_for(lambda: all(lines_of(r) for r in [*failed, ok]), TIMEOUT, "the request log lines")
    for r in failed:
        (line,) = lines_of(r)
        assert f" {r.status_code} " in line and "reason=" in line and "/v1/completions" in line, line
    (line,) = lines_of(ok)
    assert " 200 in=" in line and "out=2" in line and "reason=" not in line, line
    assert "Traceback" not in server.log_path.read_text(errors="replace")


# ---- /health with a peer killed ----------------------------------------------------------------------------


def test_health_is_503_with_a_peer_killed(tiny_model, tmp_path):
    model = tiny_model("llama")
    p = peer(model, tmp_path)
    with running(p), running(head(model, tmp_path, [p])) as w:
        assert httpx.get(f"{w.url}/health", timeout=TIMEOUT).json()["serving"] is True
        p.kill9()
        r = wait_for(
            lambda: (h := httpx.get(f"{w.url}/health", timeout=TIMEOUT)).status_code == 503 and h,
            TIMEOUT,
            "/health to turn 503",
        )
        body = r.json()
        assert body["status"] == "degraded" and body["serving"] is False and body["startup_stage"] == 5
        assert p.rpc_addr in body["reason"]
        refused = post(w, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={})
        assert_openai_error(refused, 503) and int(refused.headers["Retry-After"]) >= 1
