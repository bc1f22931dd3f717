"""A connection of the merged RPC port as the listener holds it (`Conn`: what its handshake has
read so far, its deadline, the server it speaks to), and the protocol server the listener drives
(`Server`: ComputeServer, ControlServer)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Protocol

from .wire import SocketReader


class Server(Protocol):
    """One protocol's server as the listener drives it (ComputeServer, ControlServer)."""

    header: int  # bytes of a request header
    idle_s: float  # an authenticated connection closes after this long without a request

    def open(self) -> dict: ...  # a new connection's session; session["authed"] ends the handshake

    def preauth_len(self, header: bytes, session: dict) -> int: ...  # whole frame length, or raise Refused

    def preauth(self, conn: socket.socket, frame: bytes, session: dict) -> None: ...  # raise to close

    def serve(self, conn: socket.socket, reader: SocketReader, session: dict) -> bool: ...  # one request

    def busy_reply(self, why: str) -> bytes: ...  # the answer to a request the pool drops

    # peer mode: whether a first request (its header) opens or joins the head's session
    def opens_session(self, header: bytes) -> bool: ...


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    ip: str
    deadline: float
    server: Server | None = None
    session: dict | None = None
    buf: bytearray = field(default_factory=bytearray)
    need: int = 1  # bytes `buf` must hold before the next step
    held_until: float = 0.0  # its address failed to prove the token: not read before this
    own_thread: bool = False  # peer mode: the head's session, served outside the pool
