"""Protocol versions: a peer of protocol 1 (glibc semaphores in the channel)
meets a protocol 2 one (synchronization words of its own) and gets an error
that names both versions, on the control socket and on the segment."""

from __future__ import annotations

import os
import socket

import pytest

from pleclient import protocol as p
from pleclient.channel import ChannelMap
from pleclient.errors import ProtocolMismatch


def test_a_protocol_1_hello_gets_an_error_naming_both_versions(server):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(server.socket)
        p.send_message(
            sock,
            {
                "type": p.MessageType.HELLO.value,
                "version": 1,
                "pid": os.getpid(),
                "name": "v1-client",
            },
        )
        reply, _ = p.recv_message(sock)
        closed, _ = p.recv_message(sock)
    assert reply["type"] == p.MessageType.ERROR.value
    assert reply["code"] == p.ErrorCode.VERSION_MISMATCH
    assert "client speaks protocol 1" in reply["message"]
    assert f"speaks {p.PROTOCOL_VERSION}" in reply["message"]
    assert closed is None  # and the session is closed


def test_a_segment_of_protocol_1_is_refused_naming_both_versions():
    layout = p.ChannelLayout(depth=1, capacity=16, max_row_bytes=160)
    fd = os.memfd_create("ple.test.v1", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, layout.size)
        server_side = ChannelMap(fd, layout, format_header=True)
        server_side.header[p.CH_VERSION] = 1  # what a protocol 1 server writes there
        with pytest.raises(
            ProtocolMismatch, match=f"speaks protocol 1, this client speaks {p.PROTOCOL_VERSION}"
        ):
            ChannelMap(fd, layout)
        assert server_side.close()
    finally:
        os.close(fd)
