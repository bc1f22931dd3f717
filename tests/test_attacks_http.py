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
import time

import httpx
import pytest
from rpc_workers import HTTP, head, peer, running, wait_for

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
    return HTTP.post(f"{w.url}{path}", json=body, headers=headers, timeout=timeout)


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
        return _read_response(s)


def _read_response(s: socket.socket) -> bytes:
    """One response (header and Content-Length body) from a socket."""
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
        result["r"] = HTTP.post(
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
        r = HTTP.get(f"{server.url}/health", timeout=TIMEOUT)
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
    metrics = HTTP.get(f"{server.url}/metrics", timeout=TIMEOUT).text
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
    assert HTTP.get(f"{server.url}/v1/models", timeout=TIMEOUT).status_code == 401
    assert post(server, "/v1/completions", body).status_code == 200
    assert post(server, "/v1/completions", body, headers={"X-Api-Key": KEY}).status_code == 200
    for path in ("/health", "/status", "/metrics"):
        assert HTTP.get(f"{server.url}{path}", timeout=TIMEOUT).status_code == 200, path


# ---- the log ----------------------------------------------------------------------------------------------


def test_one_log_line_per_failed_request_and_no_traceback_for_a_4xx(server):
    failed = [
        post(server, "/v1/completions", {"prompt": "hi"}, headers={}),  # 401
        post(server, "/v1/completions", {"prompt": "hi", "temperature": -1}),  # 400
        post(server, "/v1/completions", {"prompt": "hi " * 300, "max_tokens": 2}),  # 400: a prompt past the context
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
    # --peer-grace 1: the same pause for the lost peer, then 503, without the default's 15 s idle wait
    with running(p), running(head(model, tmp_path, [p], "--peer-grace", "1")) as w:
        assert HTTP.get(f"{w.url}/health", timeout=TIMEOUT).json()["serving"] is True
        p.kill9()
        r = wait_for(
            lambda: (h := HTTP.get(f"{w.url}/health", timeout=TIMEOUT)).status_code == 503 and h,
            TIMEOUT,
            "/health to turn 503",
        )
        body = r.json()
        assert body["status"] == "degraded" and body["serving"] is False and body["startup_stage"] == 5
        assert p.rpc_addr in body["reason"]
        refused = post(w, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={})
        assert_openai_error(refused, 503) and int(refused.headers["Retry-After"]) >= 1


# ==== round 3 (issue 35): fair admission, bounded outputs, deadlines and caps, /slots files, bad bodies ====


def openai_client(w, **kw):
    import openai

    return openai.OpenAI(base_url=f"{w.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT, **kw)


# ---- fair admission: `n` ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fair(tiny_model, tmp_path_factory):
    """Two slots, one waiting place: the issue's `--parallel 4 --max-queue 64`, small; room for long
    choices (`BIG_TOKENS`)."""
    w = head(
        tiny_model("llama", n_ctx=4096),
        tmp_path_factory.mktemp("fair"),
        (),
        "--dtype",
        "float32",
        "--api-key",
        KEY,
        "--max-queue",
        "1",
        parallel=2,
        ctx=4096,
    )
    with running(w) as w:
        yield w


def test_n_beyond_max_n_is_a_400_naming_n(fair):
    import openai

    client = openai_client(fair)
    with pytest.raises(openai.BadRequestError) as e:  # the slots + the queue: it would have held them all
        client.completions.create(model="m", prompt="hi", max_tokens=1, n=3)
    err = e.value.body
    assert err["param"] == "n" and "--max-n 2" in err["message"], err
    assert client.completions.create(model="m", prompt="hi", max_tokens=1, n=2).choices[1].index == 1


# Tokens of each of the big request's two choices. They run one after the other (a slot is left to
# others): at 200 a tiny model on an idle CPU finished both (~0.3 s) before a loaded test process had
# sent its first small request (CI: answered_meanwhile 0).
BIG_TOKENS = 1500


def _openai_choices(w) -> int:
    r = openai_client(w).completions.create(
        model="m", prompt="write a lot", n=2, max_tokens=BIG_TOKENS, temperature=0.7, extra_body={"ignore_eos": True}
    )
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    return r.usage.completion_tokens


def _llama_prompt_list(w) -> int:  # llama-server's /completion: a list of prompts runs as choices do
    r = HTTP.post(
        f"{w.url}/completion",
        json={"prompt": ["write a lot", "and more"], "n_predict": BIG_TOKENS, "ignore_eos": True},
        headers=AUTH,
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    return sum(c["tokens_predicted"] for c in r.json())


@pytest.mark.parametrize("big_request", [_openai_choices, _llama_prompt_list])
def test_a_large_n_request_runs_while_another_clients_small_requests_are_answered(fair, big_request):
    big_done = threading.Event()
    result = {}

    def big():
        try:
            result["tokens"] = big_request(fair)
        except BaseException as e:  # reported below
            result["tokens"] = e
        finally:
            big_done.set()

    other = openai_client(fair)  # made before the race, not in it
    t = threading.Thread(target=big)
    t.start()
    wait_for(
        lambda: (
            big_done.is_set() or any(s["is_processing"] for s in HTTP.get(f"{fair.url}/slots", headers=AUTH).json())
        ),
        TIMEOUT,
        "the big request to start",
    )
    assert not big_done.is_set(), result
    answered_meanwhile = 0
    for i in range(5):
        r = other.completions.create(model="m", prompt=f"small {i}", max_tokens=2, temperature=0)
        assert len(r.choices) == 1 and r.usage.completion_tokens <= 2  # answered, not 503
        answered_meanwhile += not big_done.is_set()
    t.join(TIMEOUT)
    assert result["tokens"] == 2 * BIG_TOKENS, result
    # A slot is always left to others: the small requests did not wait for the big one to end.
    assert answered_meanwhile >= 1, answered_meanwhile


# ---- bounded outputs ------------------------------------------------------------------------------------


def _requests_total(w) -> float:
    """Engine requests accepted so far (each embedding input is one)."""
    text = HTTP.get(f"{w.url}/metrics", timeout=TIMEOUT).text
    return next(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("hydra_requests_total"))


def test_the_embeddings_amplification_is_refused_before_anything_is_computed(tiny_model, tmp_path):
    # n_embd 768: the 68 KB of input makes ~100 MB of JSON even at the fewest bytes per float,
    # past the default --max-response (64 MiB), as with the model (n_embd 640).
    w = head(tiny_model("llama", n_embd=768), tmp_path, (), "--dtype", "float32", "--embedding", "--pooling", "none")
    with running(w):
        before = _requests_total(w)
        result = {}

        def attack():
            result["r"] = HTTP.post(f"{w.url}/embeddings", json={"input": ["a b c d e f g"] * 4000}, timeout=TIMEOUT)

        t = threading.Thread(target=attack)
        t.start()
        done = HTTP.post(
            f"{w.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0}, timeout=TIMEOUT
        )
        t.join(TIMEOUT)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3, done.text
        err = assert_openai_error(result["r"], 400, "response_too_large")
        assert "--max-response" in err["message"] and err["param"] == "input", err
        # refused from the token count alone: the engine ran the completion, no input
        assert _requests_total(w) - before == 1
        ok = HTTP.post(f"{w.url}/embeddings", json={"input": ["a b c"] * 3}, timeout=TIMEOUT)
        assert ok.status_code == 200 and len(ok.json()) == 3, ok.text


def test_any_response_beyond_max_response_is_a_400_naming_it(tiny_model, tmp_path):
    limit = 64 << 10
    w = head(
        tiny_model("llama"),
        tmp_path,
        (),
        "--dtype",
        "float32",
        "--embedding",
        "--pooling",
        "mean",
        "--max-response",
        str(limit),
        "--n-predict",
        "64",
    )
    with running(w):
        client = openai_client(w)
        # fits at the fewest bytes per float (so it is computed), not as written: refused once built
        r = HTTP.post(f"{w.url}/v1/embeddings", json={"input": ["a b c"] * 100}, timeout=TIMEOUT)
        err = assert_openai_error(r, 400, "response_too_large")
        assert f"--max-response ({limit} bytes)" in err["message"], err
        assert len(client.embeddings.create(model="m", input=["a b c"] * 4).data) == 4
        # a completion's logprobs grow with n and max_tokens
        r = HTTP.post(
            f"{w.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 200, "n": 2, "logprobs": 20, "ignore_eos": True},
            timeout=TIMEOUT,
        )
        assert_openai_error(r, 400, "response_too_large")
        r = HTTP.post(
            f"{w.url}/completion",
            json={"prompt": ["a", "b"], "n_predict": 200, "n_probs": 20, "ignore_eos": True},
            timeout=TIMEOUT,
        )
        assert_openai_error(r, 400, "response_too_large")
        # the net under every route: /tokenize's pieces
        r = HTTP.post(f"{w.url}/tokenize", json={"content": "a " * 5000, "with_pieces": True}, timeout=TIMEOUT)
        assert_openai_error(r, 400, "response_too_large")
        assert (
            HTTP.post(f"{w.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT).status_code
            == 200
        )


# ---- HTTP deadlines and connection caps (slowloris) --------------------------------------------------------

PARTIAL = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "  # headers that never end


def _connect(w, source: str = "127.0.0.1") -> socket.socket:
    """A socket to the worker from `source` (any 127.x address is this host's loopback)."""
    return socket.create_connection(("127.0.0.1", w.port), timeout=TIMEOUT, source_address=(source, 0))


def _states(socks: list[socket.socket]) -> list[str]:
    """Each socket's "open" (nothing sent back, not closed), "refused" (a 503, or closed at once),
    or what came. A refusal is sent at accept: call this once a later connection was answered."""
    time.sleep(0.5)
    out = []
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(65536)
        except BlockingIOError:
            out.append("open")
            continue
        except ConnectionResetError:
            data = b""
        out.append("refused" if not data or data.startswith(b"HTTP/1.1 503") else data.decode(errors="replace"))
    return out


def _until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(TIMEOUT)
    out = b""
    try:
        while data := s.recv(65536):
            out += data
    except ConnectionResetError:
        pass
    return out


@pytest.fixture(scope="module")
def capped(tiny_model, tmp_path_factory):
    w = head(
        tiny_model("llama"),
        tmp_path_factory.mktemp("capped"),
        (),
        "--dtype",
        "float32",
        "--max-connections",
        "20",
        "--max-client-connections",
        "8",
        "--header-timeout",
        "600",  # this fixture's sockets are closed by the tests
        parallel=1,
    )
    with running(w) as w:
        yield w


def test_one_client_holds_at_most_its_connections_and_the_rest_are_served(capped):
    attack = [_connect(capped, "127.0.0.2") for _ in range(30)]
    try:
        for s in attack:
            s.sendall(PARTIAL)
        for _ in range(3):  # another client, served meanwhile
            assert HTTP.get(f"{capped.url}/health", timeout=TIMEOUT).status_code == 200
        r = HTTP.post(f"{capped.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        states = _states(attack)
        assert states.count("open") == 8 and states.count("refused") == 22, states
    finally:
        for s in attack:
            s.close()


def test_the_total_cap_refuses_with_503_until_connections_close(capped):
    attack = [_connect(capped, f"127.0.0.{2 + i // 8}") for i in range(24)]  # 8 each from three addresses
    try:
        for s in attack:
            s.sendall(PARTIAL)
        r = HTTP.get(f"{capped.url}/health", timeout=TIMEOUT)  # accepted after the attack's: all were seen
        assert_openai_error(r, 503, "unavailable")
        assert "--max-connections" in r.json()["error"]["message"]
        states = _states(attack)
        assert states.count("open") == 20 and states.count("refused") == 4, states
    finally:
        for s in attack:
            s.close()
    wait_for(lambda: _try_health(capped) == 200, TIMEOUT, "a connection to be served once the attack's closed")


def _try_health(w) -> int | None:
    try:
        return HTTP.get(f"{w.url}/health", timeout=TIMEOUT).status_code
    except httpx.HTTPError:
        return None


@pytest.fixture(scope="module")
def deadlines(tiny_model, tmp_path_factory):
    w = head(
        tiny_model("llama"),
        tmp_path_factory.mktemp("deadlines"),
        (),
        "--dtype",
        "float32",
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        parallel=1,
    )
    with running(w) as w:
        yield w


def test_partial_headers_are_cut_off_at_the_header_deadline(deadlines):
    attack = [_connect(deadlines, "127.0.0.2") for _ in range(50)]
    for s in attack:
        s.sendall(PARTIAL)
    assert HTTP.get(f"{deadlines.url}/health", timeout=TIMEOUT).status_code == 200  # served meanwhile
    for s in attack:  # closed by the server, nothing answered
        assert _until_closed(s) == b""
        s.close()
    # the same after a first request on a kept-alive connection
    with _connect(deadlines) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(TIMEOUT)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        s.sendall(PARTIAL)
        rest = _until_closed(s)
        assert b"HTTP/1.1" not in rest, rest[:200]


def test_a_kept_alive_connection_idle_beyond_the_clients_expiry_is_still_served(server):
    """httpx (the openai client) drops an idle connection after 5 s; uvicorn's default closes ours after
    5 s too, and a request sent as it closed was lost ("Server disconnected"). Ours stays open until the
    header deadline (10 s), so the client is the one to close it."""
    with _connect(server) as s:
        for idle_s in (6.0, 0.0):  # the second request after the idle time; nothing to wait for after it
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(s).startswith(b"HTTP/1.1 200")
            time.sleep(idle_s)


def test_a_body_that_does_not_arrive_is_a_408_at_the_body_deadline(deadlines):
    lines = [
        "POST /v1/completions HTTP/1.1",
        "Host: x",
        "Content-Type: application/json",
        "Content-Length: 1000",
    ]
    with _connect(deadlines) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + b'{"prompt": "')
        reply = _until_closed(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"request_timeout"' in reply and b"--body-timeout" in reply
    assert HTTP.get(f"{deadlines.url}/health", timeout=TIMEOUT).status_code == 200


# ---- /slots keeps data -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slotted(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("slot-files")
    w = head(
        tiny_model("llama"),
        tmp_path_factory.mktemp("slots"),
        (),
        "--dtype",
        "float32",
        "--slot-save-path",
        str(folder),
        parallel=2,
    )
    with running(w) as w:
        w.folder = folder
        r = HTTP.post(f"{w.url}/v1/completions", json={"prompt": "keep this prompt", "max_tokens": 4}, timeout=TIMEOUT)
        assert r.status_code == 200
        # the slot that holds the prompt (a save of it writes tokens)
        w.slot = next(i for i in (0, 1) if _slot_act(w, i, "save", "probe.bin").json()["n_saved"] > 0)
        yield w


def _slot_act(w, slot: int, action: str, filename: str | None = None) -> httpx.Response:
    body = {"filename": filename} if filename is not None else None
    return HTTP.post(f"{w.url}/slots/{slot}", params={"action": action}, json=body, timeout=TIMEOUT)


def test_a_refused_slot_touches_no_file(slotted):
    keep = slotted.folder / "keep.bin"
    keep.write_bytes(b"precious")
    for slot in (99, -1):
        for action in ("save", "restore"):
            r = _slot_act(slotted, slot, action, "keep.bin")
            assert assert_openai_error(r, 400)["param"] == "slot"
    assert keep.read_bytes() == b"precious"


def test_a_saved_slot_is_0600_written_whole_and_nothing_else_is_left(slotted):
    r = _slot_act(slotted, slotted.slot, "save", "mine.bin")
    assert r.status_code == 200, r.text
    path = slotted.folder / "mine.bin"
    assert path.stat().st_mode & 0o777 == 0o600 and path.stat().st_size == r.json()["n_written"]
    assert not [p.name for p in slotted.folder.iterdir() if p.name.startswith(".")]


def test_concurrent_save_and_restore_of_one_name_never_fail(slotted):
    assert _slot_act(slotted, slotted.slot, "save", "busy.bin").status_code == 200
    other = 1 - slotted.slot
    failures: list[str] = []

    def saver():
        for _ in range(15):
            r = _slot_act(slotted, slotted.slot, "save", "busy.bin")
            if r.status_code != 200:
                failures.append(r.text)

    def restorer():
        for _ in range(15):
            r = _slot_act(slotted, other, "restore", "busy.bin")
            if r.status_code != 200:
                failures.append(r.text)

    threads = [threading.Thread(target=f) for f in (saver, saver, restorer, restorer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not failures, failures[:3]


def test_a_planted_symlink_is_neither_written_nor_read_through(slotted, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not yours")
    (slotted.folder / "link.bin").symlink_to(victim)
    assert assert_openai_error(_slot_act(slotted, slotted.slot, "save", "link.bin"), 400)["param"] == "filename"
    assert victim.read_bytes() == b"not yours"
    # a link to a real state: restore does not follow it either
    assert _slot_act(slotted, slotted.slot, "save", "real.bin").status_code == 200
    (slotted.folder / "link2.bin").symlink_to(slotted.folder / "real.bin")
    err = assert_openai_error(_slot_act(slotted, slotted.slot, "restore", "link2.bin"), 400)
    assert "symbolic link" in err["message"]


def test_bytes_after_the_last_state_are_refused_and_the_slot_is_untouched(slotted):
    assert _slot_act(slotted, slotted.slot, "save", "whole.bin").status_code == 200
    whole = (slotted.folder / "whole.bin").read_bytes()
    other = 1 - slotted.slot
    assert _slot_act(slotted, other, "erase").status_code == 200
    for name, data in (("junk.bin", whole + b"junk"), ("twice.bin", whole + whole), ("short.bin", whole + b"HY")):
        (slotted.folder / name).write_bytes(data)
        assert_openai_error(_slot_act(slotted, other, "restore", name), 400)
        assert _slot_act(slotted, other, "save", "after.bin").json()["n_saved"] == 0  # nothing was placed
    assert _slot_act(slotted, other, "restore", "whole.bin").status_code == 200


def test_bad_file_names_are_400_naming_filename(slotted):
    (slotted.folder / "adir").mkdir()
    for name in ("a\x00b.bin", "x" * 300, "adir", "", ".hidden", "../up.bin", "a/b"):
        for action in ("save", "restore"):
            err = assert_openai_error(_slot_act(slotted, slotted.slot, action, name), 400)
            assert err["param"] == "filename", (name, action, err)
    assert (slotted.folder / "adir").is_dir()


# ---- 400 for every bad body ------------------------------------------------------------------------------


def test_chat_template_kwargs_cannot_set_the_requests_own_fields(server):
    import openai

    messages = [{"role": "user", "content": "hi"}]
    client = openai_client(server)
    for kwargs in ({"messages": [{"role": "user", "content": "other"}]}, {"add_generation_prompt": False}):
        (key,) = kwargs
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="m", messages=messages, max_tokens=1, extra_body={"chat_template_kwargs": kwargs}
            )
        assert e.value.body["param"] == f"chat_template_kwargs.{key}", e.value.body
        for path in ("/apply-template", "/v1/chat/completions/input_tokens"):
            r = post(server, path, {"messages": messages, "chat_template_kwargs": kwargs})
            assert assert_openai_error(r, 400)["param"] == f"chat_template_kwargs.{key}"
    r = post(server, "/apply-template", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and "hi" in r.json()["prompt"]
