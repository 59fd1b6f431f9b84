"""One client must never freeze, starve or stall the others.

Each test plays a hostile but *allowed* client (or many) against a real
``pleserver serve`` process and checks what the others see: a bystander keeps
getting bit-exact rows, the control plane answers, SIGTERM ends the server
within its budget, and nothing is left behind (descriptors, threads, channel
mappings, memory)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pleclient import PleClient, PleError, RequestError
from pleclient import client as client_module
from pleclient import protocol as p
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint
from tests.harness import (
    Bystander,
    RawSession,
    cgroup_write,
    child_cgroup,
    in_cgroup,
    no_growth,
    oom_kills,
    python_child,
    quiet_footprint,
    settles_to,
    wait_until,
)

STOP_BUDGET_S = 10.0
"""SIGTERM to exit: the drain (5 s at most) and the goodbyes, well inside the
unit's TimeoutStopSec=30."""


def stops_in_budget(server) -> int:
    """SIGTERM the server; its exit status, which must come within the budget."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(STOP_BUDGET_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"still running {STOP_BUDGET_S} s after SIGTERM:\n{server.log()[-3000:]}"
        ) from None


# ------------------------------------------------- 1: runaway submit counter
RUNAWAY = """
path, attack = sys.argv[1], sys.argv[2]
client = PleClient.connect(path, name="runaway-" + attack, depth=4, capacity=64)
client.lookup(1, [1, 2, 3])
ch = client._channel
# Written by hand on purpose: no protocol-following client can do this.
if attack == "behind":  # seen − 1: 2³² − 1 submits ahead, as the server counts
    ch.publish_submit((ch.submit_counter - 1) & 0xFFFFFFFF)
else:  # one submit more than the channel has slots
    ch.publish_submit((ch.submit_counter + ch.layout.depth + 1) & 0xFFFFFFFF)
client._sock.setblocking(True)
client._sock.settimeout(10.0)
msg, _ = p.recv_message(client._sock)
after, _ = p.recv_message(client._sock)
print(json.dumps({"message": msg, "closed": after is None}), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("attack", ["behind", "ahead"])
def test_a_runaway_channel_is_closed_and_the_others_keep_being_served(
    start_server, checkpoint, references, attack
):
    server = start_server(checkpoint)
    baseline = quiet_footprint(server.pid, segments=0)
    with Bystander(server, references) as bystander:
        attacker = python_child(RUNAWAY, server.socket, attack)
        out, err = attacker.communicate(timeout=60)
        assert attacker.returncode == 0, err
        lookups_at_close = bystander.lookups
        assert wait_until(lambda: bystander.lookups > lookups_at_close + 20)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["closed"], report
    assert report["message"]["code"] == p.ErrorCode.BAD_MESSAGE
    assert re.search(
        r"channel closed: its submit counter ran \d+ submits ahead", report["message"]["message"]
    ), report
    assert no_growth(baseline, settles_to(server.pid, baseline))
    started = time.monotonic()
    assert stops_in_budget(server) == 0
    print(
        f"{attack}: closed with {report['message']['message']!r}; bystander "
        f"{bystander.lookups} lookups all exact, worst {bystander.worst_s * 1e3:.1f} ms; "
        f"SIGTERM to exit {time.monotonic() - started:.2f} s"
    )


# ------------------------------------------------------- 2: memory budget
def test_channels_past_the_memory_budget_are_refused_not_oom_killed(
    start_server, checkpoint, references
):
    """The server runs in a memory cgroup of 400 MiB, as under MemoryMax=400M.
    Without the budget the fifth or so 43 MiB channel gets it OOM-killed; with
    the default budget (3/4 of the room left at start) the channel that does
    not fit is refused with NO_RESOURCES, and one fits again once another
    client leaves."""
    with child_cgroup("memory") as cgroup:
        cgroup_write(cgroup, "memory.max", "memory.limit_in_bytes", str(400 << 20))
        server = start_server(checkpoint, "--max-clients", "32", prefix=in_cgroup(cgroup))
        assert re.search(
            r"channel memory budget: \d+ MiB, 3/4 of the room at start "
            r"\(cgroup limit 400.00 MiB",
            server.log(),
        ), server.log()
        clients, refusal = [], None
        try:
            for _ in range(16):  # 16 × 43 MiB: far over the limit
                try:
                    clients.append(server.client(capacity=16384, depth=8))
                except RequestError as exc:
                    refusal = exc
                    break
            assert refusal is not None, "every channel was granted"
            assert refusal.code == p.ErrorCode.NO_RESOURCES
            assert "max_channel_memory" in str(refusal) and "MemoryMax=" in str(refusal)
            assert len(clients) >= 2
            ids = np.arange(16384) % 20_011
            for c in clients:  # the granted ones are whole: every page touched
                assert np.array_equal(c.lookup(1, ids), references[1][ids])
            clients.pop().close()
            assert wait_until(lambda: _opens(server), 10), "no room after a client left"
            assert server.proc.poll() is None
            assert oom_kills(cgroup) == 0
            print(f"granted {len(clients) + 1} channels, then: {refusal}")
        finally:
            for c in clients:
                c.close()
        assert stops_in_budget(server) == 0


def _opens(server) -> bool:
    try:
        server.client(capacity=16384, depth=8).close()
        return True
    except RequestError:
        return False


COLD = SyntheticTable(layer=7, rows=600_011, cols=160, dtype="BF16", parts=8)
"""183 MiB of 320-byte rows: a 16 384-row lookup of rows not asked for since
the 48 MiB row cache (139 776 rows) last turned over reads ≈ 15 000 distinct
4 KiB blocks from disk."""


@pytest.fixture(scope="module")
def cold_checkpoint(tmp_path_factory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("cold")
    write_checkpoint(str(path), (COLD,), files=2)
    return path, read_reference(str(path), COLD.name)


@pytest.mark.parametrize("limit_mib, hints", [(200, True), (300, False)])
def test_cold_lookups_in_every_slot_under_a_memory_limit_never_get_the_server_oom_killed(
    start_server, cold_checkpoint, limit_mib, hints
):
    """The server in a memory cgroup (as under MemoryMax=) with a 48 MiB row
    cache: every channel the default budget grants, each with a cold
    16 384-row lookup in every slot at once, three rounds of rows never asked
    for (and, with ``hints``, as many more hinted beside them). Before the
    request path was counted, 2 such lookups under 200 MiB (4 under 300 MiB)
    got the server OOM-killed: the channels took the room that the miss
    path's read buffers (≈ 17.5 MiB a round, two rounds a thread, up to 9
    threads) needed. Now its read buffers have a bound, and what is left
    after it is what the channels are granted: every lookup is answered,
    bit-exact, a channel past the budget is refused with NO_RESOURCES, and
    the cgroup's oom_kill count stays 0."""
    model, reference = cold_checkpoint
    # Every row once, then again in the same order: by then the row cache has
    # taken in four times its size since, and holds next to none of them.
    order = np.random.default_rng(limit_mib).permutation(COLD.rows)
    taken = 0
    lock = threading.Lock()

    def cold(n: int) -> np.ndarray:
        nonlocal taken
        with lock:
            taken += n
            return order[np.arange(taken - n, taken) % order.size]

    with child_cgroup("memory") as cgroup:
        cgroup_write(cgroup, "memory.max", "memory.limit_in_bytes", str(limit_mib << 20))
        server = start_server(
            model, "--cache-size", "48M", "--max-clients", "32", prefix=in_cgroup(cgroup)
        )
        clients, refusal = [], None
        try:
            for _ in range(32):
                try:
                    clients.append(server.client(capacity=16384, depth=4))
                except RequestError as exc:
                    refusal = exc
                    break
            assert refusal is not None and refusal.code == p.ErrorCode.NO_RESOURCES, refusal
            assert clients, f"no channel granted under {limit_mib} MiB: {refusal}"
            failures: list[str] = []

            def round_of(index: int, client: PleClient) -> None:
                try:
                    if hints:
                        client.hint(COLD.layer, cold(client.depth * client.capacity), wait=5.0)
                    asked = [cold(client.capacity) for _ in range(client.depth)]
                    tickets = [client.submit(COLD.layer, ids) for ids in asked]
                    for ids, ticket in zip(asked, tickets, strict=True):
                        try:
                            if not np.array_equal(ticket.wait(), reference[ids]):
                                failures.append(f"client {index}: rows differ from the checkpoint")
                        finally:
                            ticket.release()
                except PleError as exc:
                    failures.append(f"client {index}: {type(exc).__name__}: {exc}")

            for _ in range(3):
                threads = [
                    threading.Thread(target=round_of, args=(i, c)) for i, c in enumerate(clients)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert not failures, (failures, oom_kills(cgroup), server.log_tail())
                assert server.proc.poll() is None, server.log_tail()
            stats = clients[0].stats()
            assert oom_kills(cgroup) == 0
            peak = _cgroup_peak(cgroup)
        finally:
            for c in clients:
                c.close()
        reads = stats["dataplane"]["read_buffers"]
        assert 0 < reads["peak_bytes"] <= reads["limit_bytes"], reads
        assert stops_in_budget(server) == 0
        print(
            f"{limit_mib} MiB: {len(clients)} channels granted, then {refusal}; "
            f"{3 * 4 * len(clients)} cold lookups of 16 384 rows, all exact; "
            f"read buffers peak {reads['peak_bytes'] / 2**20:.1f} of "
            f"{reads['limit_bytes'] / 2**20:.1f} MiB, {reads['waits']} rounds waited; "
            f"the cgroup's peak {peak / 2**20:.0f} MiB"
        )


def _cgroup_peak(path: Path) -> int:
    """The most memory the cgroup held (v2 ``memory.peak``, v1 ``max_usage``; 0: unknown)."""
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        try:
            return int((path / name).read_text())
        except (OSError, ValueError):
            continue
    return 0


# ------------------------------------------- 3: a peer that never reads
def test_sessions_that_never_read_their_replies_are_dropped_and_stall_no_one(
    start_server, checkpoint, references
):
    server = start_server(checkpoint)
    baseline = quiet_footprint(server.pid, segments=0)
    stats_frame = p.encode_frame({"type": "stats"})
    stuck = [RawSession(server.socket) for _ in range(20)]
    try:
        for raw in stuck:
            raw.hello()
            raw.send_bytes(stats_frame * 3000)  # and never read the replies
        with Bystander(server, references):
            assert PleClient.query_stats(server.socket)["pid"] == server.pid
            with server.client(name="newcomer") as newcomer:
                assert np.array_equal(newcomer.lookup(3, [5, 6]), references[3][[5, 6]])
        assert wait_until(lambda: server.log().count("replies it does not read") == 20), (
            server.log()[-3000:]
        )
        for raw in stuck:
            assert raw.closed_by_server(timeout=10)
    finally:
        for raw in stuck:
            raw.close()
    assert re.search(
        r"WARNING .*session \d+ .*dropped: \d+ bytes of replies it does not "
        r"read",
        server.log(),
    )
    assert no_growth(baseline, settles_to(server.pid, baseline))
    started = time.monotonic()
    assert stops_in_budget(server) == 0
    print(f"SIGTERM to exit {time.monotonic() - started:.2f} s")


# ------------------------------------------------- 4: no thread to start
def test_a_server_at_its_task_limit_still_opens_and_serves_channels(
    start_server, checkpoint, references
):
    """The server in a pids cgroup at its task limit (TasksMax=): no thread can
    start. A channel costs no thread (the serving loop sleeps on every channel
    at once), so new clients are still served, and bit-exact."""
    with child_cgroup("pids") as cgroup:
        server = start_server(checkpoint, prefix=in_cgroup(cgroup))
        with server.client() as warm:
            warm.lookup(1, [1])
        tasks = (cgroup / "pids.current").read_text().strip()
        (cgroup / "pids.max").write_text(tasks)
        try:
            for _ in range(3):
                with server.client() as client:
                    assert np.array_equal(client.lookup(1, [5, 6, 7]), references[1][[5, 6, 7]])
            assert (cgroup / "pids.current").read_text().strip() == tasks
        finally:
            (cgroup / "pids.max").write_text("max")
        assert stops_in_budget(server) == 0


# --------------------------------------- 5: hello deadline, idle, stats slot
def test_sessions_that_never_say_hello_are_closed_and_stats_always_gets_in(
    start_server, checkpoint
):
    server = start_server(
        checkpoint, "--max-clients", "2", "--hello-timeout-s", "1", "--idle-timeout-s", "1"
    )
    assert wait_until(lambda: PleClient.query_stats(server.socket)["clients"] <= 1)
    silent = [RawSession(server.socket) for _ in range(3)]  # every slot, and the spare
    try:
        with pytest.raises(PleError):  # refused at accept while they hold the slots
            PleClient.query_stats(server.socket, timeout=0.5)
        for raw in silent:
            assert raw.closed_by_server(timeout=10)
        assert "no 'hello' within 1 s of connecting" in server.log()
    finally:
        for raw in silent:
            raw.close()
    with server.client() as a, server.client() as b:  # every client slot taken
        assert PleClient.query_stats(server.socket)["clients"] >= 2  # the spare slot
        with RawSession(server.socket) as idle:  # greeted, never opens a channel
            idle.hello()
            assert idle.closed_by_server(timeout=10)
        assert "without a channel (idle_timeout_s = 1)" in server.log()
        assert a.lookup(1, [1]).shape == b.lookup(1, [1]).shape == (1, 160)


# ------------------------------------------------------- 6: fairness by rows
def test_a_small_request_waits_for_a_chunk_not_for_a_backlog(start_server, checkpoint, references):
    """Two clients queue 16 requests of 16 383 rows each, then a bystander 16
    rows, while the server is stopped (SIGSTOP): everything is pending at once.
    Served by rows, the bystander's answer comes after at most a chunk of each,
    long before the backlog; served by request, after all 32 of them."""
    server = start_server(checkpoint)
    heavy = [server.client(name=f"heavy{i}", capacity=16383, depth=16) for i in range(2)]
    small = server.client(name="small", capacity=16, depth=1)
    ids = (np.arange(16383) * 13) % 20_011
    small_ids = np.arange(16) * 7
    try:
        for _ in range(3):
            server.proc.send_signal(signal.SIGSTOP)
            try:
                tickets = [c.submit(1, ids) for c in heavy for _ in range(16)]
                ticket = small.submit(1, small_ids)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            rows = ticket.wait()
            answered = sum(t._slot.state == p.SlotState.DONE for t in tickets)
            assert np.array_equal(rows, references[1][small_ids])
            ticket.release()
            assert answered < len(tickets) // 2, (
                f"the 16-row request waited for {answered} of {len(tickets)} large ones"
            )
            print(f"answered before the 16-row request: {answered} of {len(tickets)}")
            for t in tickets:
                assert np.array_equal(t.wait(), references[1][ids])
                t.release()
    finally:
        for c in (*heavy, small):
            c.close()


# --------------------------------------- 7: reservation off the control thread
def test_reserving_a_large_channel_does_not_hold_up_other_sessions(start_server, checkpoint):
    server = start_server(checkpoint, "--max-channel-bytes", "2G")
    with RawSession(server.socket, timeout=30) as big:
        big.hello()
        big.send({"type": "open_channel", "capacity": 196608, "depth": 16})  # 0.96 GiB
        stats = PleClient.query_stats(server.socket)  # while the pages are reserved
        with server.client(capacity=64, depth=1) as other:
            other.lookup(1, [1, 2])
        readable, _, _ = select.select([big.sock], [], [], 0)
        assert not readable, "the large channel was ready before the small session ended"
        msg, fds = big.recv()
        assert msg["type"] == "channel" and len(fds) == 1
        for fd in fds:
            os.close(fd)
    assert stats["pid"] == server.pid


# ------------------------------------------------- 8: refusal log rate limit
def test_refusals_are_logged_a_few_at_a_time_with_a_count_of_the_rest(start_server, checkpoint):
    server = start_server(checkpoint, "--max-clients", "1", "--log-level", "INFO")
    holder = server.client()
    spare = RawSession(server.socket)
    spare.hello()
    try:
        for _ in range(300):  # each refused at accept, each a would-be WARNING
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(server.socket)
                s.settimeout(5)
                s.recv(4096)
        pattern = r"(\d+) more refused \(TOO_MANY_CLIENTS\) lines suppressed"
        assert wait_until(lambda: re.search(pattern, server.log()), 15), server.log()[-2000:]
        logged = server.log().count("refused connection from")
        suppressed = int(re.search(pattern, server.log()).group(1))
        assert logged <= 5 and logged + suppressed == 300, (logged, suppressed)
        print(f"300 refusals: {logged} lines, then {suppressed} counted")
    finally:
        spare.close()
        holder.close()


# ------------------------------------------------- 9: half frames, trickled
def test_half_frames_are_capped_before_hello_and_time_out_after(start_server, checkpoint):
    server = start_server(checkpoint, "--frame-timeout-s", "1")
    baseline = quiet_footprint(server.pid, segments=0)
    before_hello = [RawSession(server.socket) for _ in range(30)]
    try:
        for raw in before_hello:
            raw.send_bytes(struct.pack("<I", p.MAX_FRAME_BYTES - 1) + b"\0" * 60_000)
        for raw in before_hello:
            msg, _ = raw.recv()
            assert msg["code"] == p.ErrorCode.BAD_MESSAGE
            assert f"{p.MAX_HELLO_FRAME_BYTES}-byte limit before 'hello'" in msg["message"]
    finally:
        for raw in before_hello:
            raw.close()
    header = struct.pack("<I", p.MAX_REQUEST_FRAME_BYTES - 1)
    trickled = [RawSession(server.socket) for _ in range(10)]
    try:
        for raw in trickled:
            raw.hello()
            raw.send_bytes(header + b"\x81" * 200)  # most of the frame never comes
        open_ = list(trickled)
        deadline = time.monotonic() + 10
        while open_ and time.monotonic() < deadline:  # a byte at a time: never a frame
            for raw in list(open_):
                try:
                    raw.send_bytes(b"\0")
                except (BrokenPipeError, ConnectionResetError):
                    open_.remove(raw)  # closed by the server
            time.sleep(0.2)  # the trickle's pace (what is tested), not a synchronization
        assert not open_, f"{len(open_)} trickling sessions still open after 10 s"
        texts = []
        for raw in trickled:
            msg, _ = raw.recv()  # the error, unless the close reset the connection first
            texts.append(msg and msg["message"])
            assert raw.closed_by_server()
        assert any("a frame stayed incomplete" in t for t in texts if t), texts
        assert all("a frame stayed incomplete" in t for t in texts if t), texts
    finally:
        for raw in trickled:
            raw.close()
    now = settles_to(server.pid, baseline)
    assert no_growth(baseline, now)
    assert now.rss_kib - baseline.rss_kib < 16 << 10, (baseline, now)


# ---------------------------------------------------- 10: submit times
class _ClientClock:
    """``time`` for the client module, with a submit time of the test's choosing."""

    def __init__(self, submit_ns) -> None:
        self._submit_ns = submit_ns

    def monotonic_ns(self) -> int:
        return self._submit_ns()

    def __getattr__(self, name):
        return getattr(time, name)


def test_submit_times_a_client_could_not_have_are_not_recorded(server, monkeypatch):
    def queue_count() -> tuple[int, float]:
        table = PleClient.query_stats(server.socket)["tables"][1]
        return table["queue_time"]["count"], table["queue_time"]["max_s"]

    with server.client() as client:
        client.lookup(3, [1])
        count, _ = queue_count()
        for submit_ns in (
            lambda: 1,  # before the session
            lambda: time.monotonic_ns() + 10**12,  # in the future
            time.monotonic_ns,
        ):  # honest
            monkeypatch.setattr(client_module, "time", _ClientClock(submit_ns))
            assert client.lookup(3, [2, 3]).shape == (2, 320)
        monkeypatch.undo()
    after, worst = queue_count()
    assert after == count + 1, "an impossible submit time was recorded"
    assert worst < 60, f"queue time max {worst} s"


# ------------------------------- 11: frames that cost more than a real message
HEAVY_FRAMES = """
path, attack, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
import msgpack, struct

def frame(msg):
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("<I", len(body)) + body

hello = {"type": "hello", "version": p.PROTOCOL_VERSION, "pid": os.getpid(), "name": "heavy"}
if attack == "stats after hello":  # a valid STATS, 4 MiB of empty lists beside its type
    heavy = frame({"type": "stats", "x": [[]] * 4_000_000})
else:  # a valid HELLO of 64 KiB, nearly all of it empty lists
    base = len(msgpack.packb({**hello, "x": []}))
    heavy = frame({**hello, "x": [[]] * ((64 << 10) - base - 4)})
print("ready", flush=True)
answers, stop = [], time.monotonic() + seconds
while time.monotonic() < stop:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        if attack == "stats after hello":
            s.sendall(frame(hello))
            p.recv_message(s)
        try:
            s.sendall(heavy)
        except (BrokenPipeError, ConnectionResetError):  # refused before the last byte
            pass
        try:
            msg, _ = p.recv_message(s)
        except ConnectionResetError:
            msg = None
        answers.append(msg and (msg["type"], msg.get("message")))
print(json.dumps({"frames": len(answers), "answers": answers[:20]}), flush=True)
"""


@pytest.mark.parametrize("attack", ["stats after hello", "hello of 64 KiB"])
def test_frames_larger_than_any_real_message_are_refused_unread_and_stall_no_one(
    start_server, checkpoint, references, attack
):
    """Two processes send valid control frames that are mostly empty lists: a
    STATS of 4 MiB (each took 1.4–3 s of the GIL to decode, with the serving
    loop waiting: a 16-row lookup beside it took 0.2–3 s) or a HELLO of 64 KiB.
    Each is now refused on its length, before a byte of its body is decoded,
    and a 16-row lookup beside them stays fast."""
    server = start_server(checkpoint)
    baseline = quiet_footprint(server.pid, segments=0)
    seconds = 4.0
    attackers = [python_child(HEAVY_FRAMES, server.socket, attack, str(seconds)) for _ in range(2)]
    latencies = []
    try:
        with server.client(name="bystander", capacity=16, depth=1) as client:
            for a in attackers:
                assert a.stdout.readline().strip() == "ready", a.stderr.read()
            ids = np.arange(16) * 97
            stop = time.monotonic() + seconds - 0.5
            while time.monotonic() < stop:
                started = time.monotonic()
                rows = client.lookup(1, ids)
                latencies.append(time.monotonic() - started)
                assert np.array_equal(rows, references[1][ids])
                time.sleep(0.005)
        reports = [
            json.loads(a.communicate(timeout=60)[0].strip().splitlines()[-1]) for a in attackers
        ]
    finally:
        for a in attackers:
            if a.poll() is None:
                a.kill()
                a.communicate()
    p50, worst = float(np.median(latencies)), max(latencies)
    print(
        f"{attack}: {sum(r['frames'] for r in reports)} frames sent; bystander {len(latencies)} "
        f"lookups of 16 rows, p50 {p50 * 1e3:.2f} ms, max {worst * 1e3:.1f} ms; "
        f"answers: {reports[0]['answers'][:2]}"
    )
    # Generous bounds (a busy machine's scheduling lands here too): before the
    # limits a 4 MiB STATS held every lookup for a second or more.
    assert len(latencies) >= 50 and p50 < 0.05 and worst < 1.0, (len(latencies), p50, worst)
    limit = p.MAX_HELLO_FRAME_BYTES if attack.startswith("hello") else p.MAX_REQUEST_FRAME_BYTES
    for kind, text in (answer for r in reports for answer in r["answers"] if answer):
        assert kind == "error" and f"exceeds the {limit}-byte limit" in text, (kind, text)
    assert server.running
    assert no_growth(baseline, settles_to(server.pid, baseline))
    assert stops_in_budget(server) == 0


# ------------------------------------------- 12: opens abandoned at once
def test_channels_of_sessions_that_closed_at_once_are_not_made(
    start_server, checkpoint, references
):
    """Sessions that ask for a channel and close at once (a client killed at
    start, or one opening and closing in a loop) left their reservations
    queued, and each was made (a memfd, its pages, its header) and then
    thrown away: a bystander's open, queued behind them in the same lane,
    went from 0.009 s to 0.2–0.5 s. The reserver now skips the reservation
    of a session already gone and gives its memory back; the bystander is
    served, and every abandoned open is accounted for."""
    flood = 120
    server = start_server(checkpoint, "--max-clients", str(flood + 8), "--max-channel-memory", "4G")
    # Greeted first (the server closes a session whose welcome finds it
    # gone before it reads the open); then each asks for a 5 MiB channel
    # (made in a few ms) and closes: 120 of them made one after the other
    # is what held the bystander up.
    gone = [RawSession(server.socket, timeout=10) for _ in range(flood)]
    for raw in gone:
        raw.hello()
    for raw in gone:
        raw.send({"type": "open_channel", "capacity": 16384, "depth": 1})
        raw.close()
    with server.client(capacity=64, depth=1) as bystander:  # queued behind them
        ids = np.arange(0, 4096, 256)
        assert np.array_equal(bystander.lookup(1, ids), references[1][ids])

    def settled() -> bool:  # every abandoned reservation skipped or discarded
        return PleClient.query_stats(server.socket)["channel_memory"]["used_bytes"] == 0

    assert wait_until(settled, timeout=30), server.log_tail()
    stats = PleClient.query_stats(server.socket)
    skipped = stats["abandoned_channel_opens"]
    print(f"{flood} opens abandoned at once: {skipped} skipped, {flood - skipped} made")
    assert 0 < skipped <= flood, (skipped, server.log_tail())
    assert server.running
    assert stops_in_budget(server) == 0


def test_a_small_cold_lookup_takes_its_turn_beside_another_channels_large_cold_ones(
    start_server, checkpoint, references, tmp_path
):
    """One gather worker; one channel keeps 8 cold lookups of 16 384 rows
    queued for it (each 32 pieces of 512 rows: seconds of disk reads in all),
    then another channel's 16-row cold lookup comes. Handed to the worker
    first come, first served, it waited for all 8; taken in turns by pieces,
    it is answered after at most the piece in progress and one more, while
    most of the large ones still wait."""
    server = start_server(
        checkpoint,
        "--io",
        "direct",
        "--cache-size",
        "256K",
        "--gather-workers",
        "1",
        "--chunk-rows",
        "512",
        "--state-dir",
        str(tmp_path / "none"),
    )
    rng = np.random.default_rng(5)
    with server.client(capacity=16384, depth=8) as big, server.client(capacity=16) as small:
        tickets = [big.submit(1, rng.integers(0, 20_011, 16384)) for _ in range(8)]
        # The loop hands all 8 off within its next passes (a request of
        # parallel_min_rows rows goes to the workers whole, a few a turn).
        time.sleep(0.02)
        ids = rng.integers(0, 10_007, 16)
        assert np.array_equal(small.lookup(3, ids), references[3][ids])
        waiting = sum(t._slot.state == p.SlotState.SUBMITTED for t in tickets)
        assert waiting >= 4, f"only {waiting} of the 8 large lookups were still waiting"
        for ticket in tickets:  # and each is answered in full
            ticket.wait(timeout=120)
            ticket.release()
