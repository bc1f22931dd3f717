"""Plain functions that turn events, incidents and log lines into text: the log view's filter,
its failure labels, the head's access lines. No Textual here (tests check them without a terminal)."""

from __future__ import annotations

import re
import time

from ..contracts.errors import UserError
from .records import Event

# Log lines worth a highlight: (label, pattern). First match wins.
FAILURE_PATTERNS: list[tuple[str, re.Pattern]] = [
    (label, re.compile(rx, re.IGNORECASE))
    for label, rx in [
        ("traceback", r"^Traceback \(most recent call last\)"),
        ("out of memory", r"CUDA out of memory|OutOfMemoryError|\bout of memory\b|Cannot allocate memory"),
        ("port in use", r"Address already in use|EADDRINUSE"),
        ("connection refused", r"Connection refused|ECONNREFUSED"),
        ("fingerprint mismatch", r"fingerprint mismatch|model mismatch|shape mismatch"),
        ("timeout", r"timed out|TimeoutError"),
        ("error", r"^\w*(Error|Exception)\b|\berror:"),
    ]
]


def incident_line(inc) -> str:
    """One incident of the timeline (a triage.Incident); dated, as the timeline spans days."""
    return f"{time.strftime('%m-%d %H:%M:%S', time.localtime(inc.ts))} {inc.kind:<19} {inc.subject}: {inc.message}"


def parse_since(text: str) -> float:
    """ "90s", "30m", "2h", "7d" -> seconds (`hydra-console incidents --since`)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return float(text[:-1]) * units[text[-1]]
    except (KeyError, IndexError, ValueError):
        raise UserError(f"--since {text!r}: expected a number and s, m, h or d, e.g. 2h") from None


def event_line(ev: Event) -> str:
    who = f"{ev.worker}: " if ev.worker else ""
    return f"{time.strftime('%H:%M:%S', time.localtime(ev.ts))} {ev.kind:<11} {who}{ev.message}"


EVENT_TONES = {
    "ready": "ok",
    "crashed": "error",
    "crash-loop": "error",
    "adopted": "busy",
    "attached": "busy",
    "killed": "error",
    "error": "error",
    "unreachable": "error",
    "degraded": "warn",
    "restarted": "warn",
    "split": "busy",
    "refused": "error",
}


def failure_label(text: str) -> str | None:
    for label, rx in FAILURE_PATTERNS:
        if rx.search(text):
            return label
    return None


def compile_filter(pattern: str) -> re.Pattern | None:
    """The `/` filter: a regex, or the literal text when it is not a valid regex."""
    if not pattern:
        return None
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error:
        return re.compile(re.escape(pattern), re.IGNORECASE)


# The head's access log (engine/http_gate.py): "<12-hex id> POST /v1/completions 200 in=12 out=40 812ms".
ACCESS_LINE = re.compile(r"\b[0-9a-f]{12} [A-Z]+ /\S* \d{3}\b")


def filter_lines(lines, pattern: re.Pattern | None, invert: bool = False) -> list:
    if pattern is None:
        return list(lines)
    return [ln for ln in lines if bool(pattern.search(ln.text)) != invert]


def log_line_text(line, with_worker: bool) -> str:
    ts = time.strftime("%H:%M:%S", time.localtime(line.ts))
    who = f"{line.worker:<6} " if with_worker else ""
    return f"{ts} {who}{line.text}"
