"""Hostile or broken clients: fuzzed control messages, a slot rewritten while
the server works on it, synchronization words scribbled on, a segment resized, requests
faster than the server serves. Each gets an error status or a closed session;
the server never crashes, never reads out of bounds, and a well-behaved client
beside them keeps getting bit-exact rows."""

from __future__ import annotations

import os
import socket
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pleclient import PleClient
from pleclient import protocol as p
from tests.harness import (
    Bystander,
    RawSession,
    no_growth,
    python_child,
    quiet_footprint,
    settles_to,
)


def error_counts(server) -> dict[str, int]:
    total: dict[str, int] = {}
    for table in PleClient.query_stats(server.socket)["tables"]:
        for kind, n in table["errors"].items():
            total[kind] = total.get(kind, 0) + n
    return total


# ------------------------------------------------------------ control plane
KINDS = [m.value for m in p.MessageType] + ["", "HELLO", "x" * 300]
anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"type": st.sampled_from(KINDS) | anything},
    optional={
        "version": st.sampled_from([p.PROTOCOL_VERSION, True]) | anything,
        "capacity": st.integers(-5, 2**40) | anything,
        "depth": st.integers(-5, 100) | anything,
        "name": anything,
        "pid": anything,
    },
)


def as_frame(msg) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("<I", len(body)) + body


frame = st.one_of(
    message.map(as_frame),
    anything.map(as_frame),  # not a map, or a map without a string type
    st.binary(max_size=64),  # not even a frame
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(  # lying length
        lambda t: struct.pack("<I", t[0]) + t[1]
    ),
)


@settings(
    max_examples=250,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(greet=st.booleans(), frames=st.lists(frame, min_size=1, max_size=4))
def test_fuzzed_control_messages_get_an_error_or_a_closed_session(served, greet, frames):
    with RawSession(served.socket) as raw:
        if greet:
            raw.hello()
        for data in frames:
            try:
                raw.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server closed the session already
        try:
            raw.sock.shutdown(socket.SHUT_WR)  # no more from us: the server ends it
        except OSError:
            pass
        assert raw.closed_by_server(timeout=10), "the session stayed open after EOF"


def test_after_fuzzing_the_server_holds_nothing_extra_and_serves(served, references):
    settled = settles_to(served.pid, quiet_footprint(served.pid, segments=0))
    assert settled.segments == 0
    with Bystander(served, references) as bystander:
        bystander.wait_for_lookups(20)
    assert "internal error" not in served.log()


def test_frame_longer_than_the_limit_closes_the_session(served):
    with RawSession(served.socket) as raw:
        raw.send_bytes(struct.pack("<I", p.MAX_FRAME_BYTES + 1))
        msg, _ = raw.recv()
        assert msg["type"] == "error" and msg["code"] == p.ErrorCode.BAD_MESSAGE
        assert "exceeds" in msg["message"]
        assert raw.closed_by_server()


@pytest.mark.parametrize(
    "fields",
    [
        {"capacity": "many"},
        {"capacity": -1},
        {"capacity": 0},
        {"capacity": 2**40},
        {"capacity": 1.5},
        {"depth": 0},
        {"depth": p.MAX_DEPTH + 1},
        {"depth": None},
        {"capacity": 1 << 18, "depth": p.MAX_DEPTH},  # over max_channel_bytes
    ],
)
def test_bad_channel_geometry_is_refused_and_the_session_survives(served, fields):
    with RawSession(served.socket) as raw:
        raw.hello()
        msg, fds = raw.open_channel(**fields)
        assert not fds and msg["type"] == "error" and msg["code"] == p.ErrorCode.CHANNEL_LIMIT, msg
        msg, fds = raw.open_channel(capacity=16, depth=1)  # the session still works
        assert msg["type"] == "channel" and len(fds) == 1
        os.close(fds[0])


def test_anything_before_hello_closes_the_session(served):
    with RawSession(served.socket) as raw:
        raw.send({"type": "open_channel", "capacity": 16})
        msg, _ = raw.recv()
        assert msg["code"] == p.ErrorCode.BAD_MESSAGE and "before 'hello'" in msg["message"]
        assert raw.closed_by_server()


def test_a_stalled_half_frame_does_not_hold_up_other_clients(served, references):
    with RawSession(served.socket) as raw:
        # 1 byte of a frame of the largest size allowed, then silence
        raw.send_bytes(struct.pack("<I", p.MAX_HELLO_FRAME_BYTES) + b"\x81")
        with Bystander(served, references) as bystander:
            bystander.wait_for_lookups(20)  # served while the half frame stalls


# --------------------------------------------------------------- data plane
TAMPER = """
path, seconds = sys.argv[1], float(sys.argv[2])
import threading
client = PleClient.connect(path, name="tamperer", depth=4, capacity=4096)
ch = client._channel
cap, depth = ch.layout.capacity, ch.layout.depth
stop = time.monotonic() + seconds
counts = {"submits": 0, "rewrites": 0}

def garbage_ids(rng, n):
    kind = rng.integers(4)
    if kind == 0:
        return rng.integers(0, 10_007, n)
    if kind == 1:
        return rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)
    if kind == 2:
        return -rng.integers(1, 1000, n)
    return rng.integers(10_007, 1 << 40, n)

def garbage_count(rng):
    return int(rng.choice([0, 1, cap, cap + 1, 2**31, 2**32 - 1, rng.integers(0, cap)]))

def garbage_table(rng):
    return int(rng.choice([0, 1, 2, 3, 2**31, 2**32 - 1]))

# Hostile on purpose, so the words are written by hand, not through SlotView.
# The submitter keeps to the protocol's pacing — a slot is resubmitted once it
# is answered, or 50 ms later (a rewritten state word may have hidden it from
# the server), long after the server read the counter — so the server never
# sees more submits pending than slots; the rewriter never sets a slot
# SUBMITTED nor moves the counter (a channel whose counter runs ahead is
# dropped: tests/test_reliability_isolation.py).
outstanding = [0.0] * depth

def submitter():
    rng = np.random.default_rng(1)
    while time.monotonic() < stop:
        now = time.monotonic()
        for i, s in enumerate(ch.slots):
            if s.state in (p.SlotState.DONE, p.SlotState.ERROR) or now - outstanding[i] > 0.05:
                outstanding[i] = 0.0
        free = [i for i in range(depth) if not outstanding[i]]
        if not free:
            time.sleep(0)
            continue
        index = free[int(rng.integers(len(free)))]
        slot = ch.slots[index]
        n = int(rng.integers(0, cap + 1))
        slot.ids[:n] = garbage_ids(rng, n)
        w = slot.words
        w[p.SL_TABLE] = garbage_table(rng)
        w[p.SL_COUNT] = garbage_count(rng)
        w[p.SL_SEQUENCE] = ch.submit_counter
        w[p.SL_STATE] = p.SlotState.SUBMITTED
        outstanding[index] = time.monotonic()
        ch.publish_submit((ch.submit_counter + 1) & 0xFFFFFFFF)
        counts["submits"] += 1

def rewriter():
    rng = np.random.default_rng(2)
    while time.monotonic() < stop:
        slot = ch.slots[int(rng.integers(depth))]
        w = slot.words
        what = int(rng.integers(6))
        if what == 0:
            w[p.SL_COUNT] = garbage_count(rng)
        elif what == 1:
            w[p.SL_TABLE] = garbage_table(rng)
        elif what == 2:
            w[p.SL_STATE] = int(rng.choice([0, 2, 3, 7, 2**32 - 1]))
        elif what == 3:
            w[p.SL_SEQUENCE] = int(rng.integers(0, 2**32))
        elif what == 4:
            slot.ids[:] = garbage_ids(rng, cap)
        elif rng.integers(2):  # the slot's sleepers: the server then wakes its state word
            w[p.SL_WAITERS] = int(rng.choice([1, 2**31, 2**32 - 1]))
        else:  # "the server sleeps": the client then wakes the counter's futex
            ch.header[p.CH_SERVER_SLEEPING] = int(rng.integers(0, 2**32))
        counts["rewrites"] += 1

threads = [threading.Thread(target=submitter), threading.Thread(target=rewriter)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(counts), flush=True)
os._exit(0)
"""


def test_slot_rewritten_while_the_server_works_never_crashes_it_or_leaks_rows(served, references):
    baseline = quiet_footprint(served.pid, segments=0)
    before = error_counts(served)
    with Bystander(served, references) as bystander:
        # Rounds of 4 s until the tampering has reached validation both ways
        # (a loaded machine gives the tamperer few submits a round).
        for _ in range(10):
            tamperer = python_child(TAMPER, served.socket, "4")
            out, err = tamperer.communicate(timeout=60)
            assert tamperer.returncode == 0, err
            assert served.proc.poll() is None, served.log()[-3000:]
            after = error_counts(served)
            rejected = {kind: after[kind] - before.get(kind, 0) for kind in after}
            if rejected["bad_count"] and rejected["id_out_of_range"]:
                break
    # The tampering got through to validation (bad table indexes are refused too,
    # but no table's counters can count them).
    assert rejected["bad_count"] and rejected["id_out_of_range"], rejected
    assert no_growth(baseline, settles_to(served.pid, baseline))
    print(
        f"tamperer {out.strip()}, rejected {rejected}, bystander {bystander.lookups} "
        f"lookups all exact"
    )


@pytest.mark.parametrize(
    "table, count, ids, code, text",
    [
        (7, 3, [1, 2, 3], p.ErrorCode.BAD_TABLE, "table index 7 out of range"),
        (2**32 - 1, 3, [1, 2, 3], p.ErrorCode.BAD_TABLE, "out of range"),
        (0, 2**32 - 1, [1, 2, 3], p.ErrorCode.BAD_COUNT, "exceeds the channel capacity"),
        (1, 2, [5, -1], p.ErrorCode.ID_OUT_OF_RANGE, "id -1 at position 1"),
        (1, 2, [5, 2**62], p.ErrorCode.ID_OUT_OF_RANGE, f"id {2**62} at position 1"),
    ],
)
def test_raw_slot_words_out_of_range_get_an_error_status(served, table, count, ids, code, text):
    """What a client writes past the library's checks: the server answers with
    an error status and the session goes on."""
    from pleclient import RequestError

    with served.client(capacity=64, depth=1) as client:
        ticket = client.submit(1, [0])  # a legitimate submit, then rewritten in place
        ticket.wait()
        ticket.release()
        ch = client._channel
        slot = client.slots.take(timeout=1.0)  # held as a ticket's, then written by hand
        assert slot is ch.slots[0]
        slot.ids[: len(ids)] = ids
        w = slot.words
        w[p.SL_TABLE], w[p.SL_COUNT] = table, count
        w[p.SL_SEQUENCE] = ch.submit_counter
        w[p.SL_STATE] = p.SlotState.SUBMITTED
        client._sequence = (ch.submit_counter + 1) & 0xFFFFFFFF
        ch.publish_submit(client._sequence)
        from pleclient.client import Ticket

        with pytest.raises(RequestError, match=text) as caught:
            Ticket(client, slot, client.table(1), 1).wait()
        assert caught.value.code == code
        assert client.lookup(3, [7]).shape == (1, 320)  # the session goes on


SYNC_WORD_ATTACK = """
from pleclient.channel import COUNTER_AT
from pleclient.errors import PleError
path, attack = sys.argv[1], sys.argv[2]
client = PleClient.connect(path, name="words-" + attack, depth=2, capacity=64)
ch = client._channel
client.lookup(1, [1, 2, 3])
# The window: the server asleep on this channel (it says so before it sleeps).
deadline = time.monotonic() + 30
while ch.header[p.CH_SERVER_SLEEPING] != 1:
    assert time.monotonic() < deadline, "the server never slept on this channel"
    time.sleep(0.001)
try:
    if attack == "waiters-max":  # every sleepers word at its maximum: wake calls, no storm
        ch.header[p.CH_SERVER_SLEEPING] = 0xFFFFFFFF
        for slot in ch.slots:
            slot.words[p.SL_WAITERS] = 0xFFFFFFFF
        for _ in range(200):
            client.lookup(1, [4, 5])
        print("served", flush=True)
    elif attack == "wakes":  # futex wake-ups with no submit behind them
        stop = time.monotonic() + 2.0
        while time.monotonic() < stop:
            ch.sync.wake(COUNTER_AT)
        client.lookup(1, [4, 5])
        print("served", flush=True)
    elif attack == "counter-max":  # the counter at 2^32 - 1: ahead of all slots
        ch.publish_submit(0xFFFFFFFF)
        client._sock.setblocking(True)
        client._sock.settimeout(10.0)
        msg, _ = p.recv_message(client._sock)  # the server's answer, then the end
        after, _ = p.recv_message(client._sock)
        print("closed" if msg["type"] == "error" and after is None else msg, flush=True)
    elif attack == "state-garbage":  # its own answered slot rewritten to no state at all
        ticket = client.submit(1, [4, 5])
        while ticket._slot.state == p.SlotState.SUBMITTED:
            pass
        ticket._slot.words[p.SL_STATE] = 0xFFFFFFFF
        ticket.wait()
        print("served", flush=True)
except PleError as exc:
    print(type(exc).__name__, flush=True)
os._exit(0)
"""


@pytest.mark.parametrize(
    "attack, outcome",
    [
        ("waiters-max", "served"),  # only its own answers cost a wake call more
        ("wakes", "served"),  # each costs the loop a pass over its counters
        ("counter-max", "closed"),  # proof of a scribbled header: the session is closed
        ("state-garbage", "ProtocolMismatch"),  # its own request, its own error
    ],
)
def test_a_client_scribbling_on_its_sync_words_cannot_stop_the_server(
    served, references, attack, outcome
):
    baseline = quiet_footprint(served.pid, segments=0)
    # The bystander pauses past the server's 2 ms spin, so the server sleeps
    # beside it: the window the attacker waits for.
    with Bystander(served, references, pause_s=0.01):
        attacker = python_child(SYNC_WORD_ATTACK, served.socket, attack)
        out, err = attacker.communicate(timeout=60)
        assert served.proc.poll() is None, (
            f"the server died ({served.proc.returncode}):\n{served.log()[-2000:]}"
        )
        assert out.strip() == outcome, err
    assert no_growth(baseline, settles_to(served.pid, baseline))


SHRINK = """
client = PleClient.connect(sys.argv[1], name="shrinker")
client.lookup(3, [1])
def target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the fd listdir itself used
        return ""
fd = next(int(fd) for fd in os.listdir("/proc/self/fd") if "memfd:ple." in target(fd))
results = {}
for size in (0, 4096, os.fstat(fd).st_size * 2):
    try:
        os.ftruncate(fd, size)
        results[size] = "resized"
    except OSError as exc:
        results[size] = exc.strerror
print(json.dumps(list(results.values())), flush=True)
ids = np.arange(client.capacity) % 10_007
print(json.dumps(bool(client.lookup(3, ids).shape == (len(ids), 320))), flush=True)
"""


def test_the_client_cannot_resize_its_segment_under_the_server(served, references):
    result = python_child(SHRINK, served.socket)
    out, err = result.communicate(timeout=60)
    lines = out.splitlines()
    assert (
        lines[0] == '["Operation not permitted", "Operation not permitted", '
        '"Operation not permitted"]'
    ), (out, err)
    assert lines[1] == "true"
    assert served.proc.poll() is None


FLOOD = """
from pleclient.channel import COUNTER_AT
path, seconds, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
client = PleClient.connect(path, name="flood-" + mode)
ch = client._channel
ids = np.random.default_rng(0).integers(0, 20_011, client.capacity)
for slot in ch.slots:
    slot.ids[:] = ids
stop, submits = time.monotonic() + seconds, 0
while time.monotonic() < stop:
    if mode == "wakes":  # wake-ups with no request behind them
        ch.sync.wake(COUNTER_AT)
        submits += 1
        continue
    for slot in ch.slots:  # every slot, again and again, answered or not (by hand: hostile)
        w = slot.words
        w[p.SL_TABLE], w[p.SL_COUNT] = 0, client.capacity
        w[p.SL_SEQUENCE] = ch.submit_counter
        w[p.SL_STATE] = p.SlotState.SUBMITTED
        ch.publish_submit((ch.submit_counter + 1) & 0xFFFFFFFF)
        submits += 1
print(json.dumps(submits), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["requests", "wakes"])
def test_requests_faster_than_the_server_serves_do_not_starve_others(served, references, mode):
    baseline = quiet_footprint(served.pid, segments=0)
    with Bystander(served, references) as bystander:
        flood = python_child(FLOOD, served.socket, "3", mode)
        out, err = flood.communicate(timeout=60)
        assert flood.returncode == 0, err
    assert bystander.worst_s < 10.0  # the client timeout: served all along
    assert no_growth(baseline, settles_to(served.pid, baseline))
    print(
        f"flood of {mode}: {out.strip()} submits; bystander {bystander.lookups} lookups, "
        f"worst {bystander.worst_s * 1e3:.1f} ms"
    )
