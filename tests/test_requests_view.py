"""The head's requests in /status (slots, queue, rate, TTFT and inter-token percentiles), its access
log, and the RPC port's pool as the console shows them: a real head, the real openai client."""

from __future__ import annotations

import re
import threading

import openai
from rpc_workers import head, peer, running, wait_for

from hydra_console.app import display, log_text
from hydra_console.contracts.status import Status

# the first request's tokens: long enough that the others still find it in its slot on a loaded machine
HOLD = 2000


def test_requests_slots_queue_latency_and_access_log(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=2)
    with running(head(model, tmp_path, parallel=1, ctx=HOLD + 64)) as h:
        client = openai.OpenAI(base_url=f"{h.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(max_tokens=40):
            client.completions.create(
                model="m", prompt="count with me", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
            )

        # The first request holds the one slot for the rest of the context (its first token is out
        # before the others start); the other two then wait, and /status says so while they do.
        first = client.completions.create(
            model="m",
            prompt="count with me",
            max_tokens=HOLD,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(first))
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        busy = wait_for(lambda: (r := Status.from_json(h.status()).requests) and r.queued >= 1 and r, 60, "a queue")
        assert busy.slots_busy == busy.slots_total == 1
        assert "slots 1/1 · queue " in display.requests_text(Status.from_json(h.status()))
        for _ in first:  # read the first request to its end
            pass
        for t in threads:
            t.join(120)
        r = Status.from_json(h.status()).requests
        assert (r.requests_total, r.queued, r.slots_busy) == (3, 0, 0)
        assert r.requests_per_s > 0
        assert 0 < r.ttft_p50_ms <= r.ttft_p99_ms and 0 < r.itl_p50_ms <= r.itl_p99_ms
        # Queued requests waited for the slot: their time to first token counts the wait.
        assert r.ttft_p99_ms > r.itl_p50_ms
        access = [ln for ln in h.log().splitlines() if "POST /v1/completions 200" in ln]
        assert len(access) == 3 and all("in=" in ln and "out=" in ln and ln.rstrip().endswith("ms") for ln in access)
        assert sorted(int(re.search(r"out=(\d+)", ln).group(1)) for ln in access) == [40, 40, HOLD]
        assert log_text.ACCESS_LINE.search(access[0])
        process = Status.from_json(h.status()).process  # the worker's own memory, not the machine's
        assert process.rss > 0 and process.gpu_memory is None  # a CPU worker


def test_rpc_port_pool_counts_compute_sessions(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=2)
    with running(peer(model, tmp_path)) as p, running(head(model, tmp_path, [p])) as h:
        head_pool = Status.from_json(h.status()).pool
        peer_pool = Status.from_json(p.status()).pool
        assert peer_pool.compute >= 1  # the head's session on the peer
        assert head_pool.size > 0 and head_pool.compute == 0  # nobody runs compute on a head
        assert display.pool_text(Status.from_json(p.status())).startswith(f"RPC {peer_pool.compute} compute")
