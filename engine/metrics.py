"""Prometheus metrics with llama-server's `llamacpp:` names plus Hydra's `hydra_` ones.

Values are read from the engine's counters at scrape time (custom collectors), so the runtime
keeps one set of numbers. Other parts add their own collectors with `Metrics.register` (the RPC
layer: pool occupancy, peer RTT).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .status import StatusDocument, devices

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# llama-server types this high watermark a counter without the `_total` suffix that prometheus_client
# gives every counter: it is collected as a gauge and its TYPE line retyped when rendered.
N_TOKENS_MAX = "n_tokens_max"
_RETYPE = (f"# TYPE llamacpp:{N_TOKENS_MAX} gauge\n".encode(), f"# TYPE llamacpp:{N_TOKENS_MAX} counter\n".encode())


class _EngineCollector:
    def __init__(self, status: StatusDocument):
        self.status = status
        # The throughput gauges are llama-server's: tokens per second of processing time between two
        # scrapes (its buckets, reset by each scrape), from the totals at the last one.
        self._lock = threading.Lock()
        self._mark = (0, 0.0, 0, 0.0)

    def _since_last_scrape(self, st) -> tuple[float, float]:
        totals = (
            (st.prompt_tokens, st.prompt_seconds, st.predicted_tokens, st.predicted_seconds) if st else (0, 0.0, 0, 0.0)
        )
        with self._lock:
            last, self._mark = self._mark, totals
        (n_p, t_p, n_g, t_g), (n_p0, t_p0, n_g0, t_g0) = totals, last
        return ((n_p - n_p0) / (t_p - t_p0) if t_p > t_p0 else 0.0, (n_g - n_g0) / (t_g - t_g0) if t_g > t_g0 else 0.0)

    def collect(self):
        engine = self.status.engine
        st = engine.stats if engine is not None else None

        def counter(name: str, doc: str, value: float):
            yield CounterMetricFamily(f"llamacpp:{name}", doc, value=value)

        def gauge(name: str, doc: str, value: float):
            yield GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)

        yield from counter(
            "prompt_tokens",
            "Number of prompt tokens processed, excluding cached tokens.",
            st.prompt_tokens if st else 0,
        )
        yield from counter(
            "prompt_tokens_cached",
            "Number of prompt tokens reused from the cache.",
            st.prompt_tokens_cached if st else 0,
        )
        yield from counter("prompt_seconds", "Prompt process time.", st.prompt_seconds if st else 0.0)
        yield from counter(
            "tokens_predicted", "Number of generation tokens processed.", st.predicted_tokens if st else 0
        )
        yield from counter("tokens_predicted_seconds", "Predict process time.", st.predicted_seconds if st else 0.0)
        yield from counter("n_decode", "Total number of engine steps (forward calls).", st.steps if st else 0)
        yield from gauge(
            N_TOKENS_MAX, "Largest observed sequence length (prompt + generation).", st.n_tokens_max if st else 0
        )
        yield CounterMetricFamily("hydra_requests", "Requests accepted.", value=st.requests_total if st else 0)
        yield CounterMetricFamily(
            "hydra_requests_rejected",
            "Requests refused because the queue was full (--max-queue).",
            value=st.requests_rejected if st else 0,
        )
        prefill, decode = self._since_last_scrape(st)
        yield from gauge(
            "prompt_tokens_seconds", "Average prompt throughput in tokens/s since the last scrape.", prefill
        )
        yield from gauge(
            "predicted_tokens_seconds", "Average generation throughput in tokens/s since the last scrape.", decode
        )
        yield from gauge("requests_processing", "Number of requests processing.", engine.n_processing if engine else 0)
        yield from gauge("requests_deferred", "Number of requests deferred.", engine.n_deferred if engine else 0)
        yield from gauge(
            "n_busy_slots_per_decode",
            "Average number of busy slots per engine step.",
            st.busy_slots / max(st.steps, 1) if st else 0.0,
        )

        spec = getattr(engine, "spec_stats", None)
        yield from counter("spec_decode_num_drafts", "Speculative drafts verified.", spec.drafts if spec else 0)
        yield from counter(
            "spec_decode_num_draft_tokens", "Speculative tokens drafted.", spec.draft_tokens if spec else 0
        )
        yield from counter(
            "spec_decode_num_accepted_tokens", "Speculative tokens accepted.", spec.accepted if spec else 0
        )
        per_pos = CounterMetricFamily(
            "llamacpp:spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by position in the draft.",
            labels=["position"],
        )
        for i, n in enumerate(getattr(spec, "accepted_per_pos", None) or []):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        # The adaptive draft lengths (spec/adaptive.py): per busy slot, its k and first-token acceptance.
        draft_k = GaugeMetricFamily("hydra_spec_slot_draft_k", "Tokens the slot's last step drafted.", labels=["slot"])
        slot_acc = GaugeMetricFamily(
            "hydra_spec_slot_acceptance", "The slot's estimated acceptance of its first draft token.", labels=["slot"]
        )
        for s in engine.spec.adaptive.snapshot() if spec is not None else []:
            draft_k.add_metric([str(s["slot"])], s["k"])
            slot_acc.add_metric([str(s["slot"])], s["acceptance"][0] if s["acceptance"] else 0.0)
        yield draft_k
        yield slot_acc


class _HydraCollector:
    def __init__(self, status: StatusDocument):
        self.status = status

    def collect(self):
        up = GaugeMetricFamily(
            "hydra_startup_stage",
            "1 alive, 2 model loaded, 3 RPC active, 4 warming, 5 ready.",
            value=self.status.startup_stage,
        )
        yield up
        layers = GaugeMetricFamily(
            "hydra_stage_layers", "Layers held by each pipeline stage.", labels=["stage", "role", "first", "end"]
        )
        for i, st in enumerate(self.status.stages()):
            if st.layers:
                a, b = st.layers
                layers.add_metric([str(i), st.role, str(a), str(b)], b - a)
        yield layers
        used = GaugeMetricFamily("hydra_device_memory_used_bytes", "Device memory in use.", labels=["device", "name"])
        total = GaugeMetricFamily("hydra_device_memory_total_bytes", "Device memory size.", labels=["device", "name"])
        for d in devices():
            label = [f"{d.kind}:{d.index}", d.name]
            used.add_metric(label, d.memory_used)
            total.add_metric(label, d.memory_total)
        yield used
        yield total


class Metrics:
    """One registry per worker (never the global one, so tests and embedders can run several)."""

    def __init__(self, status: StatusDocument):
        self.start_time = int(time.time())  # llama-server's Process-Start-Time-Unix header
        self.registry = CollectorRegistry(auto_describe=False)
        self.register(_EngineCollector(status))
        self.register(_HydraCollector(status))

    def register(self, collector) -> None:
        """Add a collector (an object with `collect()` yielding metric families)."""
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry).replace(*_RETYPE)
