#!/usr/bin/env python3
"""Screenshots of the real console supervising real workers on the default model.

Starts `hydra-console`'s app headless with the default profile (head + 1 peer, Gemma 3 270M,
layers split evenly, its slots and context) on free ports, on CPU so that any machine draws the
same pictures, sends a few completions so the rates move, and writes SVGs of every screen (the
split advisor's probe and the triage screen included) to screenshots/:

    python scripts/screenshots.py [--out screenshots] [--device cpu] [--only dashboard-120x40 ...]

tests/test_screenshots.py regenerates some of them and compares their text, through `normalise`,
with the committed files: a change to the console's layout or labels needs a new run of this script.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import re
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

import httpx

from hydra_console.app.config import default_profile
from hydra_console.app.records import State
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.app.ui.dashboard import DashboardScreen

OUT = Path(__file__).resolve().parent.parent / "screenshots"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three laws of motion are"]


def free_port_pair() -> int:
    """A port whose next one is free too (a worker's HTTP port and its default RPC port)."""
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
            raise TimeoutError(f"screenshots: timed out after {timeout:g} s waiting for {what}")
        await pilot.pause(0.25)


async def load(url: str, n: int) -> None:
    """`n` completions at once, so the rates and the latencies have something to show."""
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


# Each shot goes from the dashboard to the screen it shows; `capture` returns to the dashboard after it.
async def _worker_detail(pilot) -> None:
    await pilot.press("down", "enter")
    await pilot.pause(0.5)


async def _logs(pilot) -> None:
    await pilot.press("l")
    await pilot.pause(0.8)


async def _split_editor(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.model_shape is not None, 60, "the model's shape")
    await pilot.press("s", "right", "right")
    await pilot.pause(0.3)


async def _split_advisor(pilot) -> None:
    await _split_editor(pilot)
    editor = pilot.app.screen
    await pilot.press("m")
    await wait_for(pilot, lambda: editor.advice is not None, 300, "the split advisor's probe")
    await pilot.pause(0.3)


async def _triage(pilot) -> None:
    await pilot.press("i")
    await pilot.pause(0.5)


async def _help(pilot) -> None:
    await pilot.press("question_mark")
    await pilot.pause(0.3)


async def _dashboard_80x24(pilot) -> None:
    await pilot.resize_terminal(80, 24)
    await pilot.pause(0.5)
    pilot.app.refresh_view()
    await pilot.pause()


async def _quit_confirm(pilot) -> None:
    await pilot.press("q")
    await pilot.pause(0.3)


async def _dashboard(pilot) -> None:
    pilot.app.refresh_view()
    await pilot.pause()


SHOTS: dict[str, Callable[..., Awaitable[None]]] = {
    "dashboard-120x40": _dashboard,
    "worker-detail": _worker_detail,
    "logs": _logs,
    "split-editor": _split_editor,
    "split-advisor": _split_advisor,
    "triage": _triage,
    "help": _help,
    "dashboard-80x24": _dashboard_80x24,  # from here on the terminal is 80x24
    "quit-confirm": _quit_confirm,
}


async def capture(out: Path, device: str = "cpu", only: Collection[str] = SHOTS) -> list[Path]:
    """The default profile's workers started by the real app, then the shots named in `only`, in
    SHOTS' order, as `out`/<name>.svg; every worker is stopped on the way out, whatever happens."""
    unknown = set(only) - set(SHOTS)
    if unknown:
        raise ValueError(f"no such screenshot: {', '.join(sorted(unknown))} (there are: {', '.join(SHOTS)})")
    out.mkdir(parents=True, exist_ok=True)
    profile = default_profile()
    for w in profile.workers:
        w.port = free_port_pair()
        w.rpc_port = w.port + 1
        w.device = device
    with tempfile.TemporaryDirectory(prefix="hydra-shots-", ignore_cleanup_errors=True) as scratch:
        # Its own run file: a console the user runs on the default profile is neither adopted nor watched.
        state = Path(scratch) / "run" / f"{profile.name}.json"
        sup = Supervisor(profile, log_dir=scratch, state_path=state)
        app = HydraConsole(sup)
        written = []
        try:
            async with app.run_test(size=(120, 40)) as pilot:
                await wait_for(pilot, lambda: all(w.state == State.READY for w in sup.workers.values()), 600, "workers")
                await load(sup.head.spec.url, len(PROMPTS))
                await pilot.pause(3)
                for name, show in SHOTS.items():
                    if name not in only:
                        continue
                    await show(pilot)
                    written.append(Path(app.save_screenshot(filename=f"{name}.svg", path=str(out))))
                    while not isinstance(app.screen, DashboardScreen):
                        await pilot.press("escape")
                        await pilot.pause()
        finally:
            await sup.shutdown()
    return written


# --- what the test compares: a screenshot's text less what differs between runs and machines ---

CELL_WIDTH = 12.2  # Rich's SVG export: a cell is 0.61 of its 20 px font
TEXT = re.compile(
    r'<text class="[^"]*" x="([\d.]+)" y="[\d.]+" textLength="[\d.]+" clip-path="url\(#[\w-]+-line-(\d+)\)">(.*?)</text>'
)
VOLATILE = [
    (re.compile(r"(rtt [\d.]+ ms)(?: \(max [\d.]+\))?(?: ⚠)?"), r"\1"),  # a spike since the last poll
    (re.compile(r" · \d+ spikes? ≥ [\d.]+ ms ⚠"), ""),  # an RTT chart's spikes: a loaded CPU may have one
    (re.compile(r"·*[▁▂▃▄▅▆▇█░][▁▂▃▄▅▆▇█░·]*"), "▮"),  # sparklines, usage bars, scrollbars; an RTT chart's gaps
    (re.compile(r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b"), "#B"),  # sizes: a machine's memory, a process's RSS
    (re.compile(r"\b\d+[dhm]\d\d[hms]\b|\b\d+s\b"), "#s"),  # uptimes
    (re.compile(r"(?<![A-Za-z0-9])\d+(?:\.\d+)*k?"), "#"),  # pids, addresses, rates, latencies, times, counts
]
# Numbers the profile and the model set, kept: layer ranges, splits, slots and context, a stage,
# the sizes of the slots, the queue and the pools (not how busy they are). Their digits are
# written as superscripts (KEPT_DIGITS) so that VOLATILE's masks pass them by.
KEPT = re.compile(
    r"\[\d+,\d+\)|(?:(?<=split )|(?<=running ))\d+(?:/\d+)+|\d+ slots × \d+ tokens|(?<=stage )\d+"
    r"|(?:slots|queue|pool) \d+/(?P<size>\d+)"
)
KEPT_DIGITS = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")
RUNS_OWN = re.compile(r"^╭─ Events ─")  # a panel whose lines are the run's timeline: left out up to its ╰
BLANK = re.compile(r"^[\s│┃▏▕╎▮]*$")


def screen_lines(svg: str) -> list[str]:
    """The terminal's text, row by row, as Rich's SVG export placed it (by cell, not by element)."""
    rows: dict[int, dict[int, str]] = {}
    for x, line, text in TEXT.findall(svg):
        row, col = rows.setdefault(int(line), {}), round(float(x) / CELL_WIDTH)
        for i, ch in enumerate(html.unescape(text).replace("\xa0", " ")):
            row[col + i] = ch
    return ["".join(r.get(c, " ") for c in range(max(r, default=-1) + 1)) for _, r in sorted(rows.items())]


def _keep(m: re.Match) -> str:
    at = m.start("size") - m.start() if m["size"] else 0
    return m[0][:at] + m[0][at:].translate(KEPT_DIGITS)


def normalise(svg: str) -> list[str]:
    """A screenshot's lines with what changes from run to run masked (numbers, bars, uptimes), the
    events panel's lines (when each event came, how each start went) and blank lines left out,
    and runs of spaces (column widths follow the numbers in them) made one: what stays is the
    layout, the labels and the numbers the profile and the model set (KEPT)."""
    lines, inside = [], False
    for line in screen_lines(svg):
        line = KEPT.sub(_keep, line)
        for pattern, mask in VOLATILE:
            line = pattern.sub(mask, line)
        if inside and not line.startswith("╰"):
            continue
        inside = bool(RUNS_OWN.match(line))
        if not BLANK.match(line):
            lines.append(" ".join(line.split()))
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--device", default="cpu", help="the workers' device (default cpu: the same pictures anywhere)")
    ap.add_argument("--only", nargs="+", default=list(SHOTS), choices=list(SHOTS), metavar="NAME")
    args = ap.parse_args()
    for path in asyncio.run(capture(args.out, args.device, args.only)):
        print(path)
    sys.exit(0)
