"""Where worker health and status come from: the live HTTP poller, or a fixed feed for tests.

The supervisor only sees `StatusSource.probe(spec) -> Probe`; snapshot tests swap in
`FixedFeedSource` so screens render the same bytes on every run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import httpx

from ..contracts.status import Health, Status
from .config import WorkerSpec


@dataclass(frozen=True)
class Probe:
    """One poll of one worker. reachable=False means nothing answered on its HTTP port.

    `health` and `status` arrive as JSON and are parsed here, once, into the contract's types."""

    reachable: bool
    health_code: int | None = None
    health: Health | None = None
    status: Status | None = None
    error: str | None = None
    latency_ms: float | None = None

    def __post_init__(self):
        if isinstance(self.health, dict):
            implied = "ok" if self.health_code == 200 else "starting"  # a body without a state word
            object.__setattr__(self, "health", Health.from_json({"status": implied, **self.health}))
        if isinstance(self.status, dict):
            object.__setattr__(self, "status", Status.from_json(self.status))

    @property
    def health_state(self) -> str | None:
        """ "starting" | "ok" | "degraded" from /health (a 503 without a body counts as starting)."""
        if not self.reachable:
            return None
        if self.health is not None:
            return self.health.status
        return "ok" if self.health_code == 200 else "starting"


class StatusSource(Protocol):
    async def probe(self, spec: WorkerSpec) -> Probe: ...

    async def aclose(self) -> None: ...


class HttpStatusSource:
    """GET /health and /status of a worker over one pooled httpx client."""

    def __init__(self, timeout: float = 2.0):
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)

    async def _json(self, url: str) -> tuple[int, dict | None]:
        r = await self._client.get(url)
        try:
            body = r.json()
        except ValueError:
            body = None
        return r.status_code, body if isinstance(body, dict) else None

    async def probe(self, spec: WorkerSpec) -> Probe:
        t0 = time.perf_counter()
        try:
            code, health = await self._json(f"{spec.url}/health")
        except httpx.HTTPError as e:
            return Probe(False, error=_short_error(e))
        latency = (time.perf_counter() - t0) * 1000
        try:
            status_code, status = await self._json(f"{spec.url}/status")
            if status_code != 200:
                status = None
        except httpx.HTTPError as e:
            return Probe(True, code, health, None, f"/status: {_short_error(e)}", latency)
        return Probe(True, code, health, status, None, latency)

    async def aclose(self) -> None:
        await self._client.aclose()


def _short_error(e: Exception) -> str:
    if isinstance(e, httpx.ConnectError):
        return "connection refused"
    if isinstance(e, httpx.TimeoutException):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class FixedFeedSource:
    """Answers each worker (by name) with a preset probe; unknown workers are unreachable."""

    def __init__(self, probes: dict[str, Probe]):
        self.probes = dict(probes)

    async def probe(self, spec: WorkerSpec) -> Probe:
        return self.probes.get(spec.name, Probe(False, error="connection refused"))

    async def aclose(self) -> None:
        pass
