"""Several API processes answer with TCP_NODELAY like one (issue 10, defect 12): the listening
socket of the multi-process server is bound as TCP, so asyncio turns Nagle off on every
connection it accepts. uvicorn's own multi-process socket does not (the check below shows it),
which cost every single POST a delayed ACK (~40 ms) with `serve --workers 2`."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from replay_audit.api.server import TcpConfig


def _nodelay_of_accepted(sock: socket.socket) -> int:
    """TCP_NODELAY of a connection that an asyncio server on `sock` accepts."""

    async def main() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                s = transport.get_extra_info("socket")
                seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    return asyncio.run(main())


def test_the_multi_process_socket_gives_connections_tcp_nodelay() -> None:
    ours = TcpConfig("x:y", host="127.0.0.1", port=0).bind_socket()
    assert ours.proto == socket.IPPROTO_TCP
    assert _nodelay_of_accepted(ours) == 1


def test_uvicorns_own_multi_process_socket_does_not() -> None:
    # What `uvicorn.run(..., workers=2)` binds: if uvicorn fixes this, TcpConfig can go.
    theirs = uvicorn.Config("x:y", host="127.0.0.1", port=0).bind_socket()
    assert _nodelay_of_accepted(theirs) == 0
