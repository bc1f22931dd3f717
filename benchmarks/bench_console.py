#!/usr/bin/env python3
"""Console cost: CPU while polling a head + 2 peers at 1 Hz, and keypress-to-redraw latency.

Runs the real app headless (Textual's test driver: it composes and renders every frame, the
output goes nowhere), attached to three workers that this script starts:

    python benchmarks/bench_console.py                 # stand-in workers (no model)
    python benchmarks/bench_console.py --engine real   # real hydra-engine serve + 2 peers, tiny model

CPU is this process's own time (user+sys) over the measuring window, as % of one core; the
workers run in other processes and are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from textual import events

from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.records import State
from hydra_console.app.sources import FixedFeedSource
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from screenshots import free_port_pair  # noqa: E402


def profile(engine: str, model: str) -> Profile:
    ports = [free_port_pair() for _ in range(3)]
    return Profile(
        name="bench",
        model=model,
        ctx=128,
        parallel=2,
        engine_command="" if engine == "real" else f"{shlex.quote(sys.executable)} -m hydra_console.app.fake_worker",
        head=WorkerSpec(name="head", port=ports[0], device="cpu"),
        peers=[WorkerSpec(name=f"peer{i}", port=p, device="cpu") for i, p in enumerate(ports[1:], 1)],
        supervisor=SupervisorSettings(poll_s=1.0),
    )


def start_workers(prof: Profile) -> list[subprocess.Popen]:
    """The workers, launched exactly as the console would, but outside the process under test."""
    argv_of = Supervisor(prof, source=FixedFeedSource({})).command_for
    return [
        subprocess.Popen(argv_of(w.name), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for w in [*prof.peers, prof.head]
    ]


async def key_to_frame(app, key: str, frames: list[float], timeout: float = 5.0) -> float:
    """ms from posting a key event until the app hands the next frame to the (headless) driver."""
    seen = len(frames)
    t0 = time.perf_counter()
    app._driver.send_message(events.Key(key, key if len(key) == 1 else None))
    while len(frames) == seen:
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"no frame within {timeout} s of {key!r}")
        await asyncio.sleep(0.0005)
    return (frames[seen] - t0) * 1000


async def run(engine: str, seconds: float, presses: int) -> None:
    model = ""
    if engine == "real":
        from hydra_console.engine.synth import write_synthetic

        model = str(write_synthetic(Path(tempfile.mkdtemp()) / "tiny.gguf", "llama", n_layers=6))
    prof = profile(engine, model)
    procs = start_workers(prof)
    try:
        console = Supervisor(prof, attach=True)
        app = HydraConsole(console, load_model_shape=False)
        async with app.run_test(size=(120, 40)) as pilot:
            deadline = time.monotonic() + 300
            while not all(w.state == State.READY for w in console.workers.values()):
                if time.monotonic() > deadline:
                    raise SystemExit("workers never became ready")
                await pilot.pause(0.2)
            await pilot.pause(2)
            c0, w0 = time.process_time(), time.monotonic()
            await asyncio.sleep(seconds)
            cpu = (time.process_time() - c0) / (time.monotonic() - w0) * 100
            print(
                f"engine={engine} workers=3 poll=1Hz window={seconds:.0f}s size=120x40 console CPU {cpu:.2f}% of one core"
            )

            # Frames reach _display whether or not a terminal is attached; time the first one after each key.
            frames: list[float] = []
            real_display = app._display

            def display(screen, renderable):
                if renderable is not None:
                    frames.append(time.perf_counter())
                return real_display(screen, renderable)

            app._display = display
            for name, keys in {
                "cursor down/up": ("down", "up"),
                "open/close logs": ("l", "escape"),
                "theme cycle": ("t",),
            }.items():
                samples = []
                for i in range(presses):
                    samples.append(await key_to_frame(app, keys[i % len(keys)], frames))
                    await pilot.pause(0.05)
                samples.sort()
                print(
                    f"keypress-to-redraw {name:<16} median {statistics.median(samples):6.1f} ms"
                    f"  p95 {samples[max(0, int(len(samples) * 0.95) - 1)]:6.1f} ms  (n={len(samples)})"
                )
        await console.shutdown(stop_workers=False)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["fake", "real"], default="fake")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--presses", type=int, default=40)
    args = ap.parse_args()
    asyncio.run(run(args.engine, args.seconds, args.presses))
