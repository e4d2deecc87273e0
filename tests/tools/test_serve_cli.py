"""``phalanx serve``'s own helpers and flags: the curl line it prints, and the refusals of a zero
TP degree and of ports outside the range. (Device, dtype and memory flags: test_launch_choice.py.)"""

from __future__ import annotations

import asyncio
import json
import shlex
import socket

import pytest

from phalanx.tools.cli import main
from phalanx.tools.serve import curl_line, listening_socket, port_number


def test_curl_line_posts_a_chat_completion_to_the_printed_address() -> None:
    words = shlex.split(curl_line("http://127.0.0.1:8123", "tiny-demo"))
    assert words[:2] == ["curl", "http://127.0.0.1:8123/v1/chat/completions"]
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == "tiny-demo" and body["messages"][0]["role"] == "user"


def test_serve_refuses_a_zero_tp_and_ports_outside_the_range(capsys: pytest.CaptureFixture[str]) -> None:
    # --tp 0 once fell back to the demo's default degree and served.
    assert main(["serve", "--tp", "0", "--port", "0"]) == 1
    assert (
        "phalanx serve: error: the replica did not start: tp must be at least 1, got 0"
        in capsys.readouterr().err
    )
    for port in ("70000", "-1", "http"):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--port", port])
        assert exit_info.value.code == 2
        assert f"argument --port: must be a port from 0 to 65535, got '{port}'" in capsys.readouterr().err
    assert port_number("0") == 0 and port_number("65535") == 65535


def test_connections_to_the_server_socket_send_without_nagle_s_delay() -> None:
    """asyncio turns TCP_NODELAY on for the connections it accepts only when the listening socket
    names its protocol; with Nagle's algorithm on, every non-streamed reply's body waited 40 ms
    for the client's delayed ACK of its headers."""
    server_socket = listening_socket("127.0.0.1", 0)
    port = server_socket.getsockname()[1]

    async def accepted_nodelay() -> int:
        options: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                options.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=server_socket)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(options, 10)
            finally:
                writer.close()

    assert server_socket.proto == socket.IPPROTO_TCP
    assert asyncio.run(accepted_nodelay()) != 0
