"""The workers' HTTP listening sockets (engine/worker_http.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from hydra_console.engine.errors import UserError
from hydra_console.engine.http.worker import listen_socket

pytestmark = pytest.mark.unit


def test_accepted_connections_send_without_nagle():
    """asyncio turns TCP_NODELAY on only for sockets that say IPPROTO_TCP: a listening socket made
    without it gave every accepted connection Nagle, and each response waited ~40 ms for the
    client's delayed ACK between its headers and its body."""
    sock = listen_socket("127.0.0.1", 0)
    seen = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def run():
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        while not seen:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert seen == [1]


def test_a_taken_port_names_the_address():
    first = listen_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    with pytest.raises(UserError, match=f"127.0.0.1:{port}"):
        listen_socket("127.0.0.1", port)
    first.close()
