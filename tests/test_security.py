"""Access control across uids (docs/SECURITY.md): who may connect, what another
uid can reach of a session, and what a server of its own uid needs.

Needs root (to create the users and switch to them); skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from pleclient.protocol import ErrorCode
from pleserver.synthetic import write_checkpoint
from tests.conftest import SMALL_TABLES
from tests.harness import OtherUser, other_users, python_child, run_child


@pytest.fixture(scope="module")
def users():
    """(server, client, other): the server's own uid, an allowed client's, a
    stranger's; server and client share the group ``ple-t-shared``."""
    with other_users(["ple-t-server", "ple-t-client", "ple-t-other"], "ple-t-shared") as (
        found,
        shared_gid,
    ):
        yield found, shared_gid


@pytest.fixture(scope="module")
def public():
    """A directory every uid may search, holding a world-readable checkpoint."""
    root = Path(tempfile.mkdtemp(prefix="ple-security-", dir="/tmp"))
    os.chmod(root, 0o755)
    write_checkpoint(str(root / "model"), SMALL_TABLES, files=2)
    for dirpath, _dirs, files in os.walk(root / "model"):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)
    yield root
    shutil.rmtree(root)


@pytest.fixture
def socket_dir(public, users, request):
    """A socket directory the server user owns."""
    (server_user, _, _), _ = users
    path = public / f"run-{request.node.name[:40]}"
    path.mkdir()
    os.chown(path, server_user.uid, server_user.gid)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


LOOKUP = """
path, model = sys.argv[1], sys.argv[2]
from pleserver.synthetic import read_reference
try:
    client = PleClient.connect(path, name="as-" + str(os.getuid()))
except PleError as exc:
    print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "error": type(exc).__name__,
                      "message": str(exc)}))
    sys.exit(0)
exact = 0
for t in client.tables:
    ref = read_reference(model, t.name)
    ids = np.random.default_rng(t.layer).integers(0, t.rows, 3000)
    exact += bool(np.array_equal(client.lookup(t.layer, ids), ref[ids]))
print(json.dumps({"uid": os.getuid(), "exact_tables": exact,
                  "server_pid": client.server_info["pid"]}))
"""


def lookup_as(user: OtherUser, server, public) -> dict:
    result = run_child(LOOKUP, server.socket, str(public / "model"), user=user)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_uid_not_allowed_is_refused_before_it_sees_anything(
    start_server, users, public, socket_dir
):
    (_, client_user, other), _ = users
    server = start_server(
        public / "model",
        "--allow-uid",
        str(client_user.uid),
        socket_path=str(socket_dir / "ple.sock"),
    )
    refused = lookup_as(other, server, public)
    assert refused["error"] == "AccessDenied"
    assert f"uid {other.uid} " in refused["message"] and "allow_uids" in refused["message"]
    raw = run_child(
        """
        s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
        try:
            s.sendall(p.encode_frame({"type": "stats"}))
        except BrokenPipeError:  # refused and closed already
            pass
        first, _ = p.recv_message(s)
        try:
            second, _ = p.recv_message(s)
        except ConnectionResetError:  # closed with our frame unread
            second = None
        print(json.dumps([first, second]))
    """,
        server.socket,
        user=other,
    )
    assert raw.returncode == 0, raw.stderr
    first, second = json.loads(raw.stdout)
    assert first["type"] == "error" and first["code"] == ErrorCode.NOT_ALLOWED
    assert second is None  # closed: no catalog, no stats, nothing else
    assert lookup_as(client_user, server, public)["exact_tables"] == 2
    assert f"refused connection from pid {refused['pid']} uid {other.uid}" in server.log()


def test_allow_gid_admits_the_groups_members_only(start_server, users, public, socket_dir):
    (_, client_user, other), shared_gid = users
    server = start_server(
        public / "model", "--allow-gid", str(shared_gid), socket_path=str(socket_dir / "ple.sock")
    )
    assert lookup_as(client_user, server, public)["exact_tables"] == 2
    assert lookup_as(other, server, public)["error"] == "AccessDenied"


def test_a_server_of_its_own_uid_serves_an_allowed_uid_and_refuses_others(
    start_server, users, public, socket_dir
):
    server_user, client_user, other = users[0]
    server = start_server(
        public / "model",
        "--allow-uid",
        str(client_user.uid),
        socket_path=str(socket_dir / "ple.sock"),
        user=server_user,
    )
    with open(f"/proc/{server.pid}/status") as f:
        status = dict(line.split(":", 1) for line in f)
    assert status["Uid"].split()[0] == str(server_user.uid)
    assert int(status["CapEff"], 16) == 0  # no capability at all
    allowed = lookup_as(client_user, server, public)
    assert allowed == {"uid": client_user.uid, "exact_tables": 2, "server_pid": server.pid}
    assert lookup_as(other, server, public)["error"] == "AccessDenied"
    with server.client() as client:  # root always may
        assert client.lookup(1, [1]).shape == (1, 160)


HOLD = """
client = PleClient.connect(sys.argv[1], name="holder")
client.lookup(1, [1, 2, 3])
print("ready", flush=True)
sys.stdin.read()
"""

PROBE = """
targets = [int(pid) for pid in sys.argv[1:]]
outcome = {}

def attempt(what, fn):
    try:
        fn()
        outcome[what] = "OPENED"
    except PermissionError:
        outcome[what] = "denied"
    except OSError as exc:
        outcome[what] = exc.strerror

def open_all(directory):
    def go():
        opened = 0
        for name in os.listdir(directory):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            os.close(fd)
            opened += 1
        if not opened:
            raise OSError(0, "nothing there")
    return go

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def steal_fds(pid):
    def go():
        pidfd = os.pidfd_open(pid)
        try:
            for fd in range(64):
                got = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
                if got >= 0:
                    os.close(got)
                    raise RuntimeError("took a descriptor")
                if ctypes.get_errno() == 1:
                    raise PermissionError
        finally:
            os.close(pidfd)
    return go

for pid in targets:
    attempt(f"{pid}/fd", open_all(f"/proc/{pid}/fd"))
    attempt(f"{pid}/map_files", open_all(f"/proc/{pid}/map_files"))
    attempt(f"{pid}/mem", lambda: open(f"/proc/{pid}/mem", "rb").read(1))
    attempt(f"{pid}/pidfd_getfd", steal_fds(pid))
outcome["/dev/shm"] = sorted(n for n in os.listdir("/dev/shm") if "ple" in n)
print(json.dumps(outcome))
"""


def test_another_uid_cannot_reach_a_sessions_segment(start_server, users, public, socket_dir):
    """A second uid — itself allowed to connect — finds no name to open, and no
    way into the descriptors or memory of the server or of the session's peer."""
    server_user, client_user, other = users[0]
    server = start_server(
        public / "model",
        "--allow-uid",
        str(client_user.uid),
        "--allow-uid",
        str(other.uid),
        socket_path=str(socket_dir / "ple.sock"),
        user=server_user,
    )
    holder = python_child(HOLD, server.socket, user=client_user, stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        probe = run_child(PROBE, str(server.pid), str(holder.pid), user=other)
        outcome = json.loads(probe.stdout)
        assert outcome.pop("/dev/shm") == []
        assert set(outcome.values()) == {"denied"}, outcome
        assert lookup_as(other, server, public)["exact_tables"] == 2  # its own session works
    finally:
        holder.stdin.close()
        holder.wait(10)


def test_an_unreadable_model_directory_is_a_clear_startup_error(
    start_server, users, public, socket_dir
):
    server_user = users[0][0]
    private = public / "private-model"
    shutil.copytree(public / "model", private)
    os.chmod(private, 0o700)  # root's alone
    try:
        server = start_server(
            private, socket_path=str(socket_dir / "ple.sock"), user=server_user, wait=False
        )
        assert server.exit_code() == 2
        log = server.log()
        assert f"cannot read the model directory {private}" in log and "Permission denied" in log, (
            log[-1500:]
        )
        assert not os.path.exists(socket_dir / "ple.sock")
    finally:
        shutil.rmtree(private)


def test_an_unreadable_shard_file_is_a_clear_startup_error(start_server, users, public, socket_dir):
    server_user = users[0][0]
    private = public / "private-file"
    shutil.copytree(public / "model", private)
    shard = sorted(private.glob("*.safetensors"))[0]
    os.chmod(shard, 0o600)
    try:
        server = start_server(
            private, socket_path=str(socket_dir / "ple.sock"), user=server_user, wait=False
        )
        assert server.exit_code() == 2
        assert f"{shard}: cannot read (Permission denied)" in server.log()
    finally:
        shutil.rmtree(private)


def test_a_socket_directory_the_server_may_not_write_is_a_clear_startup_error(
    start_server, users, public
):
    server_user = users[0][0]
    server = start_server(
        public / "model", socket_path=str(public / "ple.sock"), user=server_user, wait=False
    )  # `public` is root's, 0755
    assert server.exit_code() == 2
    assert "cannot bind" in server.log() and "Permission denied" in server.log()


# ----------------------------------------------------------- the state directory
@pytest.mark.parametrize("mode", [0o777, 0o750], ids=["0777", "0750"])
def test_saving_the_hot_set_never_writes_through_a_planted_link(start_server, tmp_path, mode):
    """A link planted where the save used to put its temp file
    (``hotset.bin.tmp.<pid>``) and one at ``hotset.bin`` point at a victim
    file, as another uid can do in a state directory it may write (0777). Such
    a directory is now refused: neither restored nor saved, with an ERROR that
    says how to fix it. In a directory of the server's alone (0750) the save
    creates a temp file of a random name, O_EXCL | O_NOFOLLOW, and renames it
    over the link. Either way the victim is untouched (before: overwritten at
    SIGTERM)."""
    model = write_checkpoint(str(tmp_path / "model"), SMALL_TABLES, files=2)
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, mode)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    os.chmod(victim, 0o600)
    before = victim.stat()
    server = start_server(model, "--io", "direct", "--state-dir", str(state))
    with server.client() as client:
        client.lookup(1, [1, 2, 3])
    os.symlink(victim, state / f"hotset.bin.tmp.{server.pid}")
    os.symlink(victim, state / "hotset.bin")
    assert server.stop() == 0
    log = server.log()
    assert victim.read_bytes() == b"precious\n"
    after = victim.stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    if mode == 0o777:
        assert (
            f"ERROR pleserver.server: hot set: state_dir {state} is writable by group and "
            "others (mode 0777)" in log
        ), log[-3000:]
        assert "chmod 0750" in log
        assert os.path.islink(state / "hotset.bin")  # nothing there was touched
    else:
        assert stat.S_ISREG(os.lstat(state / "hotset.bin").st_mode), log[-3000:]


def test_a_state_dir_owned_by_another_uid_is_refused(start_server, users, tmp_path):
    """Its owner may plant links in it whatever its mode: refused like a
    directory others may write; the server serves on without a hot set."""
    other = users[0][2]
    model = write_checkpoint(str(tmp_path / "model"), SMALL_TABLES, files=2)
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, other.uid, other.gid)
    os.chmod(state, 0o755)
    server = start_server(model, "--io", "direct", "--state-dir", str(state))
    with server.client() as client:
        assert client.stats()["hotset"] is None
        assert client.lookup(1, [1]).shape == (1, 160)
    assert server.stop() == 0
    assert f"state_dir {state} is owned by uid {other.uid}, not by this server's uid 0" in (
        server.log()
    )
    assert os.listdir(state) == []


# ----------------------------------------------------------- a connect flood
FLOOD = """
path, seconds = sys.argv[1], float(sys.argv[2])
print("ready", flush=True)
connected = full = 0
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
        connected += 1
    except BlockingIOError:
        full += 1
    except OSError:
        pass
    s.close()
print(json.dumps({"connected": connected, "full": full}), flush=True)
"""

NEWCOMERS = """
path, count, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ok, failures = 0, []
for _ in range(count):
    try:
        with PleClient.connect(path, name="newcomer", capacity=16, depth=1) as client:
            client.lookup(1, [1, 2, 3])
        ok += 1
    except PleError as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
    time.sleep(gap)
print(json.dumps({"ok": ok, "failures": failures}), flush=True)
"""


def test_a_connect_flood_from_a_refused_uid_locks_out_no_new_client(
    start_server, users, public, socket_dir
):
    """Three processes of a uid the server refuses open and close connections
    as fast as they can. Before: the listen backlog (128) stayed full, new
    clients of an allowed uid failed at once with EAGAIN (`ServerUnavailable`),
    and the server spent its CPU refusing. Now the backlog is as long as
    somaxconn allows, a refusal costs an accept, a frame encoded once and a
    close, a uid past its accept rate is refused before anything else, and a
    client retries a full queue: all 17 newcomers get in, the bystander is
    served, and the refusals are counted."""
    (_, client_user, other), _ = users
    server = start_server(
        public / "model",
        "--allow-uid",
        str(client_user.uid),
        socket_path=str(socket_dir / "ple.sock"),
    )
    seconds = 8.0
    flood = [python_child(FLOOD, server.socket, str(seconds), user=other) for _ in range(3)]
    latencies = []
    try:
        with server.client(name="bystander", capacity=16, depth=1) as bystander:
            for f in flood:
                assert f.stdout.readline().strip() == "ready", f.stderr.read()
            newcomers = python_child(NEWCOMERS, server.socket, "17", "0.3", user=client_user)
            ids = np.arange(16) * 101
            while newcomers.poll() is None:
                started = time.monotonic()
                bystander.lookup(1, ids)
                latencies.append(time.monotonic() - started)
                time.sleep(0.005)
            out, err = newcomers.communicate(timeout=60)
            floods = [json.loads(f.communicate(timeout=60)[0].splitlines()[-1]) for f in flood]
            refused = bystander.stats().get("refused", {})
    finally:
        for f in flood:
            if f.poll() is None:
                f.kill()
                f.communicate()
    report = json.loads(out.splitlines()[-1]) if out.strip() else {"error": err}
    p50, worst = float(np.median(latencies)), max(latencies)
    print(
        f"flood: {sum(f['connected'] for f in floods)} connections, "
        f"{sum(f['full'] for f in floods)} found the queue full; newcomers {report}; "
        f"refused {refused}; bystander {len(latencies)} lookups, p50 {p50 * 1e3:.2f} ms, "
        f"max {worst * 1e3:.0f} ms"
    )
    assert report.get("ok") == 17 and not report.get("failures"), report
    assert p50 < 0.05 and worst < 2.0, (p50, worst)
    assert refused.get("not_allowed", 0) > 0 and refused.get("rate_limited", 0) > 0, refused
    assert server.running
    started = time.monotonic()
    assert server.stop() == 0 and time.monotonic() - started < 10
