"""Protocol versions: a peer of protocol 1 (glibc semaphores in the channel)
meets a protocol 2 one (synchronization words of its own) and gets an error
that names both versions, on the control socket and on the segment."""

from __future__ import annotations

import os
import socket

import pytest

from pleclient import PleClient
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


def test_every_client_message_at_its_largest_is_read_within_the_limits():
    """The limits on client frames come from the client's messages: each, every
    field at its largest, fits the frame size and decodes within them."""
    import msgpack

    for msg in p.CLIENT_MESSAGES:
        body = msgpack.packb(msg, use_bin_type=True)
        assert len(body) <= p.MAX_REQUEST_FRAME_BYTES
        assert p.decode_body(body, p.AFTER_HELLO) == msg
    hello = msgpack.packb(p.HELLO_AT_ITS_LARGEST, use_bin_type=True)
    assert len(hello) <= p.MAX_HELLO_FRAME_BYTES
    assert p.decode_body(hello, p.BEFORE_HELLO) == p.HELLO_AT_ITS_LARGEST
    for extra in ([[]] * 3, {"x": 1}, b"\0"):  # nothing a real message holds
        with pytest.raises(p.FrameError):
            p.decode_body(msgpack.packb({"type": "stats", "x": extra}), p.AFTER_HELLO)


def test_a_client_with_a_long_name_still_connects(server):
    with PleClient.connect(server.socket, name="w" * 5000) as client:
        assert client.lookup(1, [1]).shape == (1, 160)
    assert f"({'w' * p.MAX_NAME_CHARS})" in server.log()
