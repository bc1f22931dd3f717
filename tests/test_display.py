"""Display functions and the split editor's memory estimate, without a terminal."""

from __future__ import annotations

import json

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hydra_console.app import display, log_text, memory_text
from hydra_console.app.config import Alerts, Profile, WorkerSpec
from hydra_console.app.records import LogLine, State
from hydra_console.app.sources import FixedFeedSource, Probe
from hydra_console.app.split_plan import ModelShape, WorkerMemory
from hydra_console.app.supervisor import Supervisor
from hydra_console.contracts.footprint import CUDA_RUNTIME_BYTES
from hydra_console.contracts.status import ProcessInfo, Status
from hydra_console.engine.errors import UserError


def test_every_state_has_a_distinct_symbol_and_word():
    profile = Profile()
    sup = Supervisor(profile, attach=True, source=FixedFeedSource({}))
    w = sup.head
    seen = set()
    for state in State:
        w.state = state
        text, tone = display.state_text(w, now=0.0)
        symbol, word = text.split(" ", 1)
        assert symbol and word.startswith(state.value)
        assert tone in {"ok", "warn", "error", "busy", "muted"}
        seen.add(text)
    assert len(seen) == len(State)  # readable without colour: no two states print the same


def test_backoff_state_shows_seconds_left():
    sup = Supervisor(Profile(), source=FixedFeedSource({}))
    w = sup.head
    w.state, w.backoff_until = State.BACKOFF, 108.0
    assert display.state_text(w, now=100.0) == ("↻ backoff 8s", "warn")


async def test_a_sleeping_head_is_ready_and_asleep():
    """--sleep-idle-seconds: the head's /status says `sleeping`; the row says so beside its state."""
    feed = FixedFeedSource({"head": Probe(True, 200, {"status": "ok"}, {"role": "head", "sleeping": True})})
    sup = Supervisor(Profile(), attach=True, source=feed, clock=lambda: 0.0)
    await sup.poll_once()
    assert sup.head.state == State.READY
    assert display.state_text(sup.head, now=0.0) == ("● ready, asleep", "ok")


def test_a_crash_loop_row_names_its_cause():
    sup = Supervisor(Profile(), source=FixedFeedSource({}))
    w = sup.head
    w.state, w.backoff_until, w.last_exit = State.CRASH_LOOP, 104.0, 2
    w.last_err = "hydra-engine: error: model file not found: /models/missing-model-of-a-long-name.gguf"
    row, tone = display.worker_row(w, sup, now=100.0)
    assert row[5] == "⟳ crash-loop 4s" and tone == "error"
    assert row[-1].startswith("2: hydra-engine: error: model file not found") and row[-1].endswith("…")
    w.state = State.BACKOFF
    assert display.worker_row(w, sup, now=100.0)[0][-1] == "2"  # one crash: the code only


@pytest.mark.parametrize(
    "secs,text", [(None, "—"), (0, "0s"), (59.9, "59s"), (61, "1m01s"), (3661, "1h01m"), (90000, "1d01h")]
)
def test_fmt_duration(secs, text):
    assert display.fmt_duration(secs) == text


@pytest.mark.parametrize(
    "n,text", [(None, "—"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (139 * 2**30, "139.0 GiB")]
)
def test_fmt_bytes(n, text):
    assert display.fmt_bytes(n) == text


def test_rates_layers_pct():
    assert display.fmt_rate(12.345) == "12.3 tok/s"
    assert display.fmt_rate(2500) == "2.5k tok/s"
    assert display.fmt_layers([9, 18]) == "[9,18)" and display.fmt_layers(None) == "—"
    assert display.fmt_pct(0.9) == "90%" and display.fmt_pct(None) == "—"


@given(used=st.floats(0, 1e12), total=st.floats(1, 1e12), width=st.integers(1, 60))
def test_bar_has_exact_width_and_grows_with_use(used, total, width):
    b = display.bar(used, total, width)
    assert len(b) == width and set(b) <= {"█", "░"}
    assert b.count("█") <= display.bar(min(used * 2, total), total, width).count("█") or used > total


def test_bar_without_total_is_empty():
    assert display.bar(5, 0, 4) == "░░░░" and display.bar(None, 10, 3) == "░░░"


@pytest.mark.parametrize(
    "line,label",
    [
        ("Traceback (most recent call last):", "traceback"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "out of memory"),
        ("OSError: [Errno 98] Address already in use", "port in use"),
        ("peer 10.0.0.2:8091: [Errno 111] Connection refused", "connection refused"),
        ("hydra-engine: error: model fingerprint mismatch with peer 127.0.0.1:8091", "fingerprint mismatch"),
        ("ValueError: bad thing", "error"),
        ("INFO: serving tiny on http://127.0.0.1:8080", None),
    ],
)
def test_failure_patterns(line, label):
    assert log_text.failure_label(line) == label


def test_filter_regex_invert_and_literal_fallback():
    lines = [LogLine(i, 0.0, "head", t) for i, t in enumerate(["GET /health 200", "GET /status 200", "error: x ["])]
    rx = log_text.compile_filter(r"/(health|status)")
    assert [ln.text for ln in log_text.filter_lines(lines, rx)] == ["GET /health 200", "GET /status 200"]
    assert [ln.text for ln in log_text.filter_lines(lines, rx, invert=True)] == ["error: x ["]
    bad = log_text.compile_filter("x [")  # not a regex: matched literally, never an exception
    assert [ln.text for ln in log_text.filter_lines(lines, bad)] == ["error: x ["]
    assert log_text.filter_lines(lines, log_text.compile_filter("")) == lines


def test_memory_estimate_counts_each_stage_as_its_worker_holds_it(tiny_model):
    path = tiny_model("llama", n_layers=4, n_embd=256, n_ff=256, qtype="Q4_K")
    shape = ModelShape.from_gguf(path)
    cpu, gpu = WorkerMemory("cpu"), WorkerMemory("cuda")
    est = shape.estimate([3, 1], n_ctx=64, n_slots=2, workers=[cpu, cpu])
    assert [e.layers for e in est] == [(0, 3), (3, 4)]
    assert est[0].kv_bytes == 3 * est[1].kv_bytes > 0
    # A GPU keeps Q4_K in its bits (144 bytes per 256 weights) where a CPU holds int8 terms and a bf16 copy.
    on_gpu = shape.estimate([3, 1], n_ctx=64, n_slots=2, workers=[cpu, gpu])
    assert on_gpu[0] == est[0] and on_gpu[1].weight_bytes < est[1].weight_bytes / 5
    assert (
        on_gpu[1].kv_bytes == est[1].kv_bytes * (64 + 4) // 64
    )  # + ROLLBACK positions a slot for the graphs' padding rows
    q8 = shape.estimate([3, 1], n_ctx=64, n_slots=2, workers=[WorkerMemory("cpu", kv_types=("q8_0", "q8_0"))] * 2)
    assert [e.kv_bytes for e in q8] == [e.kv_bytes * 17 // 32 for e in est]  # 34 bytes per 32 values, not 64
    with pytest.raises(UserError, match="covers 3 layers"):
        shape.estimate([2, 1], 64, 2, [cpu, cpu])


def test_a_gpu_workers_measured_runtime_replaces_the_default(tiny_model):
    """A running GPU worker's /status measures its CUDA context and kernels (NVML's reading less
    torch's reservation): its estimate counts that instead of the H200's default; a CPU's has none."""
    shape = ModelShape.from_gguf(tiny_model("llama", n_layers=4, n_embd=256, n_ff=256, qtype="Q4_K"))
    default, measured = shape.estimate(
        [3, 1], 64, 2, [WorkerMemory("cuda"), WorkerMemory("cuda", runtime_bytes=300 << 20)]
    )
    assert default.runtime_bytes == CUDA_RUNTIME_BYTES and measured.runtime_bytes == 300 << 20
    assert measured.total == measured.weight_bytes + measured.kv_bytes + measured.work_bytes + (300 << 20)
    (cpu,) = shape.estimate([4], 64, 2, [WorkerMemory("cpu", runtime_bytes=300 << 20)])
    assert cpu.runtime_bytes == cpu.work_bytes == 0
    process = ProcessInfo(gpu_memory=5 << 30, gpu_source="nvml", device_reserved=4 << 30)
    assert process.runtime_bytes == 1 << 30
    assert ProcessInfo(gpu_memory=5 << 30, gpu_source="torch", device_reserved=5 << 30).runtime_bytes is None
    assert ProcessInfo.from_json(process.to_json()).runtime_bytes == 1 << 30


def test_memory_form_says_how_a_worker_holds_its_stage():
    assert memory_text.memory_form(WorkerMemory("cpu")) == "(cpu): weights int8 + bf16 prefill copy, KV bf16/bf16"
    assert memory_text.memory_form(WorkerMemory("cpu", "float32")) == "(cpu): weights at float32, KV f32/f32"
    assert (
        memory_text.memory_form(WorkerMemory("cuda", kv_types=("q8_0", "f16")))
        == "(cuda): weights as in the GGUF, KV q8_0/f16"
    )
    assert (
        memory_text.memory_form(WorkerMemory("cuda", gpu_weights="dense"))
        == "(cuda): weights at bfloat16, KV bf16/bf16"
    )
    mixed = [WorkerMemory("cuda"), WorkerMemory("cpu"), WorkerMemory("cuda")]
    assert memory_text.memory_forms(["head", "peer1", "peer2"], mixed) == (
        "head, peer2 (cuda): weights as in the GGUF, KV bf16/bf16; peer1 (cpu): weights int8 + bf16 prefill copy, KV bf16/bf16"
    )


STATUS = {
    "role": "head",
    "pid": 4242,
    "uptime_s": 75.0,
    "state": "ok",
    "startup_stage": 5,
    "stages": [
        {"role": "head", "addr": "127.0.0.1:8081", "layers": [0, 9]},
        {"role": "peer", "addr": "127.0.0.1:8091", "layers": [9, 18]},
    ],
    "devices": [
        {"index": 0, "kind": "cuda", "name": "H200", "memory_used": 95 * 2**30, "memory_total": 100 * 2**30, "util": 40}
    ],
    "throughput": {"prefill_tok_s": 1234.5, "decode_tok_s": 56.7},
    "speculative": {"type": "ngram", "acceptance": 0.9, "mean_accepted_len": 2.7, "drafts": 12},
    "pool": {"size": 2, "busy": 1, "queued": 3, "dropped": 4, "connections": 4, "compute": 1},
    "requests": {
        "slots_busy": 4,
        "slots_total": 4,
        "queued": 2,
        "queue_max": 16,
        "requests_per_s": 0.75,
        "ttft_p50_ms": 120.4,
        "ttft_p99_ms": 401.0,
        "itl_p50_ms": 30.2,
        "itl_p99_ms": None,
    },
    "peers": [{"addr": "127.0.0.1:8091", "state": "up", "rtt_ms": 80.0, "layers": [9, 18]}],
}


async def test_rows_and_panels_from_a_status_document():
    feed = FixedFeedSource({"head": Probe(True, 200, {"status": "ok"}, STATUS)})
    sup = Supervisor(Profile(), attach=True, source=feed, clock=lambda: 0.0)
    await sup.poll_once()
    row, tone = display.worker_row(sup.head, sup, now=0.0)
    assert dict(zip(display.WORKER_COLUMNS, row)) == {
        "worker": "head",
        "role": "head",
        "host": "127.0.0.1",
        "device": "cuda:0",
        "layers": "[0,9)",
        "state": "● ready",
        "pid": "4242",
        "uptime": "1m15s",
        "rst": "0",
        "exit": "—",
    }
    peer_row, peer_tone = display.worker_row(sup.workers["peer1"], sup, now=0.0)
    assert peer_row[4] == "[9,18)" and peer_row[5] == "✖ unreachable" and peer_tone == "error"
    mem = memory_text.memory_rows(sup, Alerts())
    assert [(m.label, m.tone, m.note) for m in mem] == [
        ("machine cuda:0", "warn", "util 40% (head)")
    ]  # 95% >= 90% alert
    assert "95.0 GiB/100.0 GiB ⚠" in display.memory_line(mem[0])
    status = sup.head.status  # parsed once, by the probe
    assert display.acceptance_text(status) == "spec ngram: accept 90% · mean len 2.70 · drafts 12"
    mtp = Status.from_json({"speculative": {**STATUS["speculative"], "type": "mtp"}})
    assert display.acceptance_text(mtp) == "MTP acceptance 90% · mean len 2.70 · drafts 12"
    assert display.pool_text(status) == "RPC 1 compute · control pool 1/2 busy, 3 queued, 4 dropped · 3 idle sockets"
    assert display.requests_text(status) == "slots 4/4 · queue 2/16 · 0.75 req/s · p50/p99 TTFT 120/401 · ITL 30/— ms"
    peer_pool = Status.from_json({"pool": {"connections": 1, "compute": 1, "accepted": 3}})
    assert display.pool_text(peer_pool) == "RPC 1 compute · 1 idle sockets"
    pooled_peer = Status.from_json(
        {"role": "peer", "pool": {"size": 2, "busy": 1, "queued": 3, "dropped": 4, "compute": 1}}
    )
    assert display.pool_text(pooled_peer) == "RPC 1 compute · pool 1/2 · 3 queued · 4 dropped"
    assert display.peer_lines(status, Alerts()) == [("127.0.0.1:8091 ● up rtt 80.0 ms ⚠ [9,18)", "warn")]
    same_gpu = Status.from_json({"peers": [{**STATUS["peers"][0], "rtt_ms": 0.1, "transport": "cuda-ipc"}]})
    assert display.peer_lines(same_gpu, Alerts()) == [("127.0.0.1:8091 ● up rtt 0.1 ms [9,18) · cuda-ipc", "ok")]
    spiked = Status.from_json({"peers": [{**STATUS["peers"][0], "rtt_ms": 0.4, "rtt_max_ms": 812.5}]})
    assert display.peer_lines(spiked, Alerts()) == [("127.0.0.1:8091 ● up rtt 0.4 ms (max 812.5) ⚠ [9,18)", "warn")]
    assert display.acceptance_text(Status()) == "spec off" and display.pool_text(None) == "RPC —"
    assert (
        display.requests_text(Status.from_json({"slots": [{"state": "processing"}, {}]})) == "slots 1/2 busy"
    )  # an older head
    snap = json.loads(display.snapshot_json(sup))
    assert [(w["name"], w["state"], w["reachable"], w["layers"]) for w in snap["workers"]] == [
        ("head", "ready", True, [0, 9]),
        ("peer1", "unreachable", False, [9, 18]),
    ]


async def test_each_peers_merged_port_pool_comes_from_its_own_status():
    peer = {"role": "peer", "pool": {"size": 2, "busy": 2, "queued": 5, "queue_max": 64, "dropped": 3, "compute": 1}}
    older = {"role": "peer", "pool": {"compute": 1, "connections": 1}}  # a peer that runs no pool
    head = {
        **STATUS,
        "peers": [{"addr": f"127.0.0.1:{port}", "state": "up", "rtt_ms": 0.5} for port in (8091, 8093, 8095)],
    }
    profile = Profile(peers=[WorkerSpec(name=n, port=p) for n, p in (("peer1", 8090), ("peer2", 8092), ("p3", 8094))])
    feed = FixedFeedSource(
        {
            "head": Probe(True, 200, {"status": "ok"}, head),
            "peer1": Probe(True, 200, {"status": "ok"}, peer),
            "peer2": Probe(True, 200, {"status": "ok"}, older),
        }
    )
    sup = Supervisor(profile, attach=True, source=feed)
    await sup.poll_once()
    assert display.peer_lines(sup.head.status, Alerts(), display.peer_pools(sup)) == [
        ("127.0.0.1:8091 ● up rtt 0.5 ms — · pool 2/2 · 5 queued · 3 dropped", "warn"),
        ("127.0.0.1:8093 ● up rtt 0.5 ms — · port 1 compute · 0 dropped", "ok"),
        ("127.0.0.1:8095 ● up rtt 0.5 ms —", "ok"),  # no answer from it: the head's view only
    ]


def test_peer_layers_come_from_its_own_status_when_it_has_one():
    sup = Supervisor(Profile(peers=[WorkerSpec(name="p", port=8090)]), attach=True, source=FixedFeedSource({}))
    sup.workers["p"].probe = Probe(
        True, 200, {"status": "ok"}, {"stages": [{"role": "peer", "addr": "127.0.0.1:8091", "layers": [5, 18]}]}
    )
    assert display.worker_layers(sup.workers["p"], sup) == [5, 18]


async def test_machine_totals_appear_once_and_each_worker_shows_its_own_rss():
    cpu = {"devices": [{"index": 0, "kind": "cpu", "name": "CPU", "memory_used": 6 << 30, "memory_total": 16 << 30}]}
    feed = FixedFeedSource(
        {"head": Probe(True, 200, {"status": "ok"}, cpu), "peer1": Probe(True, 200, {"status": "ok"}, cpu)}
    )
    sup = Supervisor(Profile(), attach=True, source=feed, clock=lambda: 0.0)
    await sup.poll_once()
    sup.head.rss, sup.head.cpu_pct = 1 << 30, 50.0
    rows = memory_text.memory_rows(sup, Alerts())
    assert [(r.label, r.used, r.note) for r in rows] == [
        ("machine RAM", 6 << 30, "(head, peer1)"),
        ("head RSS", 1 << 30, "cpu 50%"),
    ]
    assert memory_text.device_free(sup, "head") == (10 << 30, True)  # one machine's RAM, both workers on it


async def test_gpu_workers_show_their_own_process_memory_beside_the_device_total():
    gpu = {"index": 0, "kind": "cuda", "name": "H200", "memory_used": 40 << 30, "memory_total": 140 << 30}
    head = {"devices": [gpu], "process": {"rss": 3 << 30, "gpu_memory": 12 << 30, "gpu_source": "nvml"}}
    peer = {"devices": [gpu], "process": {"rss": 2 << 30, "gpu_memory": 28 << 30, "gpu_source": "torch"}}
    feed = FixedFeedSource(
        {"head": Probe(True, 200, {"status": "ok"}, head), "peer1": Probe(True, 200, {"status": "ok"}, peer)}
    )
    sup = Supervisor(Profile(), attach=True, source=feed, clock=lambda: 0.0)
    await sup.poll_once()
    rows = [(r.label, r.used, r.total, r.note) for r in memory_text.memory_rows(sup, Alerts())]
    ram = psutil.virtual_memory().total  # local workers that report no RAM device: this machine's
    assert rows == [
        ("machine cuda:0", 40 << 30, 140 << 30, "(head, peer1)"),  # the machine's total, once
        ("head RSS", 3 << 30, ram, ""),
        ("head GPU", 12 << 30, 140 << 30, "per process"),
        ("peer1 RSS", 2 << 30, ram, ""),
        ("peer1 GPU", 28 << 30, 140 << 30, "torch reserved"),
    ]


def test_draft_slots_text_shows_each_slots_k_and_acceptance_only_when_the_head_adapts():
    spec = {
        "type": "mtp",
        "draft_max": 3,
        "adaptive": True,
        "slots": [
            {"slot": 0, "k": 2, "acceptance": [0.9, 0.714, 0.5]},
            {"slot": 1, "k": 0, "acceptance": []},
        ],
    }
    status = Status.from_json({"speculative": spec})
    assert display.draft_slots_text(status) == "draft k s0 k=2 (90% 71% 50%) · s1 k=0"
    assert display.draft_slots_text(Status.from_json({"speculative": {**spec, "adaptive": False}})) == ""
    assert display.draft_slots_text(Status.from_json({"speculative": {**spec, "slots": []}})) == ""
    assert display.draft_slots_text(None) == "" and display.draft_slots_text(Status()) == ""


async def test_the_steps_phases_between_two_polls_read_as_milliseconds_a_step():
    """The head's /status totals at two polls: the steps between them, their wall time by phase."""

    def status(steps: int, **phase_s) -> dict:
        return {**STATUS, "throughput": {**STATUS["throughput"], "steps_total": steps, "step_phase_s": phase_s}}

    feed = FixedFeedSource(
        {"head": Probe(True, 200, {"status": "ok"}, status(100, schedule=1.0, forward=5.0, read=2.0, emit=0.5))}
    )
    sup = Supervisor(Profile(), attach=True, source=feed, clock=lambda: 0.0)
    await sup.poll_once()
    assert display.step_text(sup.head.history) == ""  # one answer: no interval yet
    feed.probes["head"] = Probe(True, 200, {"status": "ok"}, status(500, schedule=1.4, forward=9.8, read=2.4, emit=0.7))
    await sup.poll_once()
    assert display.step_text(sup.head.history) == "step 14.5 ms · schedule 1.0 · forward 12.0 · read 1.0 · emit 0.5"
    await sup.poll_once()  # the same totals again: no step ran between
    assert display.step_text(sup.head.history) == ""
