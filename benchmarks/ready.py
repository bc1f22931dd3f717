"""Benchmark support: wait until a worker process serves /health 200."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_ready(
    port: int, what: str, budget_s: float = 120.0, proc: subprocess.Popen | None = None, host: str = "127.0.0.1"
) -> None:
    """Poll http://HOST:PORT/health every 0.2 s; SystemExit if `proc` exits or the budget runs out."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited {proc.returncode}")
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} not ready after {budget_s:g} s")
