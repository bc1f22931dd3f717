#!/usr/bin/env python3
"""Screenshots of the real console supervising real workers on the default model.

Starts `hydra-console`'s app headless with the default profile (head + 1 peer, Gemma 3 270M,
layers split evenly) on free ports, sends a few completions so the rates move, and writes SVGs
of every screen (the split advisor's probe and the triage screen included) to screenshots/:

    python scripts/screenshots.py [--out screenshots] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hydra_console.app.config import default_profile
from hydra_console.app.records import State
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three laws of motion are"]


def free_port_pair() -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


async def wait_for(pilot, cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"screenshots: timed out waiting for {what}")
        await pilot.pause(0.25)


async def load(url: str, n: int) -> None:
    """`n` completions at once: more than the slots, so some queue (the requests line shows it)."""
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/completions",
                    json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, "temperature": 0},
                )
                for i in range(n)
            )
        )


async def main(out: Path, device: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    profile = default_profile()
    for w in profile.workers:
        w.port = free_port_pair()
        w.rpc_port = w.port + 1
        w.device = device
    profile.ctx = 1024
    profile.parallel = 2
    sup = Supervisor(profile, log_dir=tempfile.mkdtemp(prefix="hydra-shots-"))
    app = HydraConsole(sup)

    def shot(name: str) -> None:
        path = app.save_screenshot(filename=f"{name}.svg", path=str(out))
        print(path)

    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: all(w.state == State.READY for w in sup.workers.values()), 600, "workers ready")
        await load(sup.head.spec.url, 4)
        await pilot.pause(3)
        app.refresh_view()
        await pilot.pause()
        shot("dashboard-120x40")
        await pilot.press("down", "enter")
        await pilot.pause(0.5)
        shot("worker-detail")
        await pilot.press("escape", "l")
        await pilot.pause(0.8)
        shot("logs")
        await pilot.press("escape", "s")
        await wait_for(pilot, lambda: app.model_shape is not None, 30, "model shape")
        await pilot.press("escape", "s", "right", "right")
        await pilot.pause(0.3)
        shot("split-editor")
        editor = app.screen
        await pilot.press("m")
        await wait_for(pilot, lambda: editor.advice is not None, 300, "the split advisor's probe")
        await pilot.pause(0.3)
        shot("split-advisor")
        await pilot.press("escape", "i")
        await pilot.pause(0.5)
        shot("triage")
        await pilot.press("escape", "question_mark")
        await pilot.pause(0.3)
        shot("help")
        await pilot.press("escape")
        await pilot.resize_terminal(80, 24)
        await pilot.pause(0.5)
        app.refresh_view()
        await pilot.pause()
        shot("dashboard-80x24")
        await pilot.press("q")
        await pilot.pause(0.3)
        shot("quit-confirm")
        await pilot.press("y")
        await wait_for(pilot, lambda: not sup.running_managed(), 60, "workers to stop")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "screenshots")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    asyncio.run(main(args.out, args.device))
    sys.exit(0)
