"""What every worker serves over HTTP, head and peer alike: `/health`, `/status`, `/metrics`, and
the listening socket they are served on. The head's app adds the OpenAI and llama-server routes."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ..config import HttpLimits
from ..errors import UserError
from ..metrics import CONTENT_TYPE, Metrics
from ..status import StatusDocument
from .drain import Drain
from .errors import error_response
from .guard import guarded_h11


def add_observation_routes(app: FastAPI, status: StatusDocument, metrics: Metrics | None) -> None:
    """`metrics` None: /metrics is off (llama-server's --no-metrics), 501 in its error shape."""

    @app.get("/health")
    async def health():
        h = status.health()
        return JSONResponse(h.to_json(), status_code=h.http_code)

    @app.get("/status")
    async def get_status():
        return (await asyncio.to_thread(status.document)).to_json()

    @app.get("/metrics")
    async def get_metrics():
        if metrics is None:
            return error_response(
                501, "This server does not support metrics endpoint. Start it with `--metrics`", "not_supported_error"
            )
        res = Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)
        # spelled as llama-server sends it: header names are case-insensitive, but not every client's lookup is
        res.raw_headers.append((b"Process-Start-Time-Unix", str(metrics.start_time).encode()))
        return res


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP port before anything slow, so a taken port fails at once with its address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets that say TCP. Without it a
    # response's headers and body meet Nagle and the client's delayed ACK: 40 ms added to every request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock


def listen_sockets(hosts: str, port: int) -> list[socket.socket]:
    """One listening socket per address of a comma-separated `--host` (llama-server's form,
    e.g. "127.0.0.1,::1")."""
    socks: list[socket.socket] = []
    try:
        for host in hosts.split(","):
            socks.append(listen_socket(host.strip().strip("[]"), port))
    except UserError:
        for s in socks:
            s.close()
        raise
    return socks


def http_server(app: FastAPI, limits: HttpLimits | None = None, drain: Drain | None = None) -> uvicorn.Server:
    """`drain`: the head's, run on a stop signal before uvicorn's own shutdown (http/drain.py)."""
    # h11, not httptools: httptools' writer lowercases header names, and llama-server's clients see
    # its spelling (Access-Control-Allow-Origin, Process-Start-Time-Unix); uvloop stays ("auto").
    # guard.py's subclass of it adds the connection caps and the header and body deadlines.
    # An idle kept-alive connection is closed by the header deadline (default 10 s), not by uvicorn's
    # 5 s: httpx (so the openai client) drops its idle connections after 5 s too, and a request it sent
    # on one as we closed it was lost ("Server disconnected without sending a response").
    limits = limits or HttpLimits()
    config = uvicorn.Config(
        app,
        http=guarded_h11(limits),
        log_level="warning",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=limits.header_timeout,
    )
    return DrainingServer(config, drain)


class DrainingServer(uvicorn.Server):
    """uvicorn, whose shutdown (on SIGTERM / SIGINT, or a failed load) first runs `drain`: the
    requests in flight end, finished or with a clean 503, before uvicorn closes the port and then
    cancels whatever is still running after `timeout_graceful_shutdown`."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None = None):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and self.drain is not None:  # a second signal: no more grace
            self.drain.hurry()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        if self.drain is not None:
            await self.drain.run()
        await super().shutdown(sockets)
