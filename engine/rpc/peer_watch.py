"""Watching a peer from the head: a probe on a connection of its own while a reply is pending, and
the window of round trips that /status reports."""

from __future__ import annotations

import socket
import time
from collections import deque

from ...contracts.rpc import Cmd
from .compute import pack_hello
from .peer_errors import PeerUnavailable
from .wire import FrameError, SocketReader, pack_compute_request, read_compute_response

WATCH_S = 1.0  # while a reply is pending, probe the peer this often
PROBE_ANSWER_S = 2.0
# /status `rtt_max_ms`: the worst round trip this recent, so a spike between two polls of a console
# (or hidden behind a normal round trip just before the poll) still shows on its timeline.
RTT_WINDOW_S = 10.0


def probe(addr: str, host: str, port: int) -> None:
    """Called every WATCH_S while a reply is pending. A fresh connection must get a HELLO answer
    within PROBE_ANSWER_S (peer mode serves it on its own thread, even mid-forward): a host that
    vanished (no RST ever comes) or a frozen process fails the request in 2-3 s, not at TCP
    keepalive's 60 s or never."""
    try:
        with socket.create_connection((host, port), timeout=WATCH_S) as conn:
            conn.settimeout(PROBE_ANSWER_S)  # a busy CPU peer may be slow to schedule the answer
            conn.sendall(pack_compute_request(Cmd.HELLO, pack_hello()))
            read_compute_response(SocketReader(conn), 4096)
    except (OSError, FrameError) as e:
        raise PeerUnavailable(f"peer {addr} stopped answering: {e}") from None


class RttWindow:
    """The round trips of the last RTT_WINDOW_S: the last one and the worst."""

    def __init__(self):
        self.last: float | None = None
        self._times: deque[tuple[float, float]] = deque()  # (monotonic time, ms)

    def note(self, ms: float) -> float:
        now = time.monotonic()
        self.last = ms
        self._times.append((now, ms))
        while self._times[0][0] < now - RTT_WINDOW_S:
            self._times.popleft()
        return ms

    @property
    def worst(self) -> float | None:
        """None: none measured in the window."""
        since = time.monotonic() - RTT_WINDOW_S
        return max((ms for t, ms in list(self._times) if t >= since), default=None)
