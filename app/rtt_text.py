"""A peer's round-trip times over the last polls as one line of bars, for the dashboard and the
triage screen. Plain text: the bars' heights and the words beside them say what colour would."""

from __future__ import annotations

import math

from .display import fmt_duration

LEVELS = "▁▂▃▄▅▆▇█"
GAP = "·"  # a poll without a round trip: the peer was down or not measured yet


def chart_cells(width: int) -> int:
    """Bars that fit beside the label: 30 polls on an 80-column terminal, 60 from 100 columns."""
    return 30 if width < 100 else 60


def _scale_top(x: float) -> str:
    """Rounded up: the stated scale covers the worst bar."""
    return f"{math.ceil(x)}" if x >= 10 else f"{math.ceil(x * 10) / 10:.1f}"


def rtt_chart(samples: list[tuple[float, float | None]], alert_ms: float, cells: int) -> tuple[str, str]:
    """("▁▁▁█▇▇▁ 0–813 ms · 1 spike ≥ 50 ms ⚠ · 59s", "warn") over the newest `cells` of `samples`
    (time, worst round trip in ms or None), oldest left. The bars scale from 0 to the alert or the
    worst shown, whichever is higher: a healthy link is a row of low bars and a spike stands up.
    A spike is a run of polls at or above the alert (the head's worst of ~10 s holds one stall for
    several polls)."""
    shown = list(samples)[-cells:]
    rtts = [ms for _, ms in shown if ms is not None]
    if not rtts:
        return ("no round trip measured yet", "muted")
    top = max(alert_ms, *rtts)
    bars = "".join(GAP if ms is None else LEVELS[max(round(ms / top * len(LEVELS)), 1) - 1] for _, ms in shown)
    spikes = sum(
        1
        for i, (_, ms) in enumerate(shown)
        if ms is not None and ms >= alert_ms and (i == 0 or shown[i - 1][1] is None or shown[i - 1][1] < alert_ms)
    )
    span = f" · {fmt_duration(shown[-1][0] - shown[0][0])}" if len(shown) > 1 else ""
    if not spikes:
        return (f"{bars} 0–{_scale_top(top)} ms{span}", "ok")
    plural = "s" if spikes > 1 else ""
    return (f"{bars} 0–{_scale_top(top)} ms · {spikes} spike{plural} ≥ {alert_ms:g} ms ⚠{span}", "warn")
