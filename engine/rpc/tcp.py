"""The TCP settings of an RPC link, both ends (the head's client, the merged port's listener), and
the listener's quiet send and shutdown of a socket that may already be gone."""

from __future__ import annotations

import socket

KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}


def tune_socket(conn: socket.socket) -> None:
    """TCP_NODELAY (one small frame per decode step) and keepalive 30/10/3 (find dead peers)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)  # a refusal is small: it fits a fresh socket's buffer or is lost
    except OSError:
        pass


def shutdown_quietly(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
