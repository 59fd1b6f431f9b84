"""Access control across uids (docs/SECURITY.md): who may connect, what another
uid can reach of a session, and what a server of its own uid needs.

Needs root (to create the users and switch to them); skipped otherwise."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pleclient import PleClient
from pleclient.protocol import ErrorCode
from pleserver.devkit.synthetic import write_checkpoint
from tests.conftest import SMALL_TABLES
from tests.harness import (
    PRELUDE,
    REPO,
    OtherUser,
    child_env,
    other_users,
    python_child,
    run_child,
    stop_process,
    wait_until,
)


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
from pleserver.devkit.synthetic import read_reference
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


# The groups a peer had when it connected, not what its pid is by accept time.
JOIN_AFTER_CONNECT = """
path, uid, gid, joined = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([])
os.setresgid(gid, gid, gid)
os.setresuid(0, uid, 0)  # effective: the uid; real and saved root, to join a group later
s = socket.socket(socket.AF_UNIX)
s.connect(path)  # the kernel records uid, gid and no supplementary group
p.send_message(s, {"type": "hello", "version": p.PROTOCOL_VERSION, "pid": 1, "name": "joiner"})
os.seteuid(0)
os.setgroups([joined])
os.seteuid(uid)
with open("/proc/self/status") as f:
    groups = next(line.split()[1:] for line in f if line.startswith("Groups:"))
print(json.dumps({"pid": os.getpid(), "groups": groups}), flush=True)
s.settimeout(60)
reply, _ = p.recv_message(s)
print(json.dumps(reply), flush=True)
"""


def test_a_group_joined_after_connecting_does_not_let_a_peer_in(
    start_server, users, public, socket_dir
):
    """A process of a uid outside the lists connects (with no supplementary
    group), then joins an allowed group while its connection waits for accept
    (the server is stopped meanwhile). Before: the server read the groups from
    ``/proc/<pid>/status`` at accept, found the allowed group and greeted the
    uid. Now the groups are the ones the kernel recorded at connect
    (SO_PEERGROUPS): refused, NOT_ALLOWED, with the reason."""
    (_, _, other), shared_gid = users
    server = start_server(
        public / "model", "--allow-gid", str(shared_gid), socket_path=str(socket_dir / "ple.sock")
    )
    stop_process(server.pid)
    try:
        joiner = python_child(
            JOIN_AFTER_CONNECT, server.socket, str(other.uid), str(other.gid), str(shared_gid)
        )
        line = joiner.stdout.readline()
        assert line, joiner.stderr.read()
        joined = json.loads(line)
        assert joined["groups"] == [str(shared_gid)]  # what /proc says by accept time
    finally:
        os.kill(server.pid, signal.SIGCONT)
    out, err = joiner.communicate(timeout=60)
    assert joiner.returncode == 0, err
    reply = json.loads(out.splitlines()[-1])
    assert reply["type"] == "error" and reply["code"] == ErrorCode.NOT_ALLOWED, reply
    assert f"uid {other.uid} may not use this ple-server" in reply["message"]
    assert "the groups it had when it connected count" in reply["message"]
    assert f"refused connection from pid {joined['pid']} uid {other.uid}" in server.log()


CONNECT_AND_LEAVE = """
# Connect and say hello, then hand the connection to a child and exit: the pid
# the kernel recorded at connect is gone (the test reaps it) before the server
# accepts. The child prints what the server answers.
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
p.send_message(s, {"type": "hello", "version": p.PROTOCOL_VERSION, "pid": 1, "name": "leaver"})
print(os.getpid(), flush=True)
if os.fork() == 0:
    s.settimeout(60)
    try:
        reply, _ = p.recv_message(s)
    except OSError as exc:
        reply = {"error": str(exc)}
    print(json.dumps(reply), flush=True)
    os._exit(0)
os._exit(0)
"""

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _take_pid(pid: int, user: OtherUser, tries: int = 300) -> subprocess.Popen | None:
    """A process of ``user`` (with its supplementary groups) that has pid
    ``pid``, made by setting the pid namespace's last pid before each fork;
    None when that cannot be set, or other processes of the host keep taking
    the pid first."""
    for _ in range(tries):
        try:
            with open(NS_LAST_PID, "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(
            ["sleep", "120"], user=user.uid, group=user.gid, extra_groups=list(user.groups)
        )
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_a_pid_reused_by_an_allowed_groups_member_does_not_let_a_peer_in(
    start_server, users, public, socket_dir
):
    """The attack of the bug: a process of a uid outside the lists connects
    and exits while its connection waits for accept (it handed the
    connection to a child); a process of a member of an allowed group takes its
    pid. Before: the server read that member's groups from
    ``/proc/<pid>/status``, and greeted the stranger. Now: refused."""
    (_, member, other), shared_gid = users
    server = start_server(
        public / "model", "--allow-gid", str(shared_gid), socket_path=str(socket_dir / "ple.sock")
    )
    stop_process(server.pid)
    sleeper = None
    try:
        leaver = python_child(CONNECT_AND_LEAVE, server.socket, user=other)
        line = leaver.stdout.readline()
        assert line, leaver.stderr.read()
        pid = int(line)
        assert leaver.wait(30) == 0  # reaped: the pid is free
        sleeper = _take_pid(pid, member)
        if sleeper is None:
            pytest.skip(f"cannot make a process of pid {pid} ({NS_LAST_PID} refused or raced)")

        def member_holds_pid() -> bool:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f)
            return status["Uid"].split()[0] == str(member.uid) and str(shared_gid) in (
                status["Groups"].split()
            )

        assert wait_until(member_holds_pid, 10)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    try:
        out, err = leaver.communicate(timeout=60)  # the child's answer, on the same pipe
        assert out.strip(), err
        reply = json.loads(out.splitlines()[-1])
        assert reply.get("type") == "error" and reply["code"] == ErrorCode.NOT_ALLOWED, reply
        assert f"refused connection from pid {pid} uid {other.uid}" in server.log()
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()


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


# The CLI's modules are imported before the privilege drop (PRELUDE): the
# interpreter's own files may not be readable by the other user.
CLI_AS_USER = (
    "from pleserver import cli, config\n"
    "from pleserver.data import budget\n"
    "from pleserver.ops import doctor\n" + PRELUDE + "sys.exit(cli.main(sys.argv[1:]))\n"
)


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
        # inspect and doctor say the same, and doctor does not ask for the model it has
        for command in (["inspect", str(private)], ["doctor", "--model", str(private)]):
            ran = subprocess.run(
                [sys.executable, "-c", CLI_AS_USER, *command, "--json"],
                env=child_env(server_user),
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert ran.returncode != 0, ran.stdout
            said = ran.stdout + ran.stderr
            expected = f"(Permission denied for uid {server_user.uid})"
            assert f"cannot read the model directory {private}" in said, said[-1500:]
            assert expected in said and "give --model" not in said, said[-1500:]
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


def test_a_socket_directory_that_does_not_exist_is_named_and_not_created(
    start_server, public, tmp_path
):
    missing = tmp_path / "typo" / "ple.sock"
    server = start_server(public / "model", socket_path=str(missing), wait=False)
    assert server.exit_code() == 2
    assert f"the socket's directory {missing.parent} does not exist" in server.log()
    assert not missing.parent.exists()


def test_a_stale_socket_of_another_uid_in_a_sticky_directory_is_named_with_the_fix(
    start_server, users, public
):
    server_user = users[0][0]
    sticky = public / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    stale = sticky / "ple.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))  # root's, and no one listens on it
    dead.close()
    # As bound: the server's user may not even connect to it
    server = start_server(public / "model", socket_path=str(stale), user=server_user, wait=False)
    assert server.exit_code() == 2
    log = server.log()
    assert f"socket {stale} exists, belongs to uid 0" in log, log[-1500:]
    assert "may not connect to it" in log and f"sudo rm {stale}" in log
    # Open to all: found stale, and then not removable from the sticky directory
    os.chmod(stale, 0o777)
    server = start_server(public / "model", socket_path=str(stale), user=server_user, wait=False)
    assert server.exit_code() == 2
    log = server.log()
    assert f"cannot remove the stale socket {stale}" in log, log[-1500:]
    assert f"belongs to uid 0 and {sticky} is sticky" in log and f"sudo rm {stale}" in log
    assert "Traceback" not in log
    stale.unlink()
    sticky.rmdir()


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


# ------------------------------------------------------- one uid filling the server
HOG = """
path, tries, keepalive = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "keepalive"
import threading
lost = []

def keep_alive(sock):
    # STATS every 0.25 s: never idle for idle_timeout_s, so its slot stays taken
    while True:
        p.send_message(sock, {"type": "stats"})
        reply, _ = p.recv_message(sock)
        if reply is None or reply["type"] != "stats":
            lost.append(reply)
            return
        time.sleep(0.25)

if keepalive:  # a greeted session without a channel, first
    keep = socket.socket(socket.AF_UNIX)
    keep.connect(path)
    keep.settimeout(10)
    p.send_message(keep, {"type": "hello", "version": p.PROTOCOL_VERSION, "pid": 1, "name": "hog"})
    assert p.recv_message(keep)[0]["type"] == "welcome"
    threading.Thread(target=keep_alive, args=(keep,), daemon=True).start()
held, refusals = [], []
for _ in range(tries):  # as many tiny channels as it can get
    try:
        held.append(PleClient.connect(path, name="hog", capacity=1, depth=1))
    except PleError as exc:
        refusals.append(f"{type(exc).__name__}: {exc}")
rows = held[0].lookup(1, [1]).shape[0] if held else 0
print(json.dumps({"channels": len(held), "refused": len(refusals),
                  "first_refusal": refusals[0] if refusals else None, "rows": rows}), flush=True)
for command in sys.stdin:  # "free": close one client; EOF: done
    held.pop().close()
    print(json.dumps({"channels": len(held)}), flush=True)
print(json.dumps({"keepalive_lost": lost}), flush=True)
"""

PLUGIN_RECONNECT = """
from pleclient.errors import ServerGone
from pleclient.vllm_plugin.rows import RowService
from pleclient.vllm_plugin.settings import ShmSettings
_become(sys.argv[1])  # after the imports: the venv may be under a directory of root's alone

def attempt(what, connect):
    print(what, flush=True)
    started = time.monotonic()
    try:
        client = connect()
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}",
                          "after_s": time.monotonic() - started}), flush=True)
        sys.exit(0)
    rows = client.lookup(1, [1, 2, 3]).shape[0]
    print(json.dumps({"waited_s": time.monotonic() - started, "rows": rows}), flush=True)

# A worker's first connect (at the first layer's bind), then a reconnect of a
# worker whose session was lost: each while the server is full for this uid.
first = RowService(ShmSettings.from_env())
attempt("starting", lambda: first._connect_at_startup(None))
lost = RowService(ShmSettings.from_env())

def reconnect():
    lost.reconnect(ServerGone("the test's lost session"), time.monotonic())
    return lost.client

attempt("reconnecting", reconnect)
"""


def _report(child: subprocess.Popen) -> dict:
    line = child.stdout.readline()
    assert line, child.stderr.read()
    return json.loads(line)


def test_one_uid_cannot_lock_out_other_uids_root_or_pleserver_stats(
    start_server, users, public, socket_dir
):
    """An allowed uid opens a greeted session kept alive with STATS past
    idle_timeout_s, then tries to open max_clients (64) tiny channels. Before:
    it got all of them (65 sessions), and another allowed uid, root's clients
    and `pleserver stats` were all refused (AccessDenied), and the plugin's
    reconnect gave up at once on that. Now, with the default limits: the uid
    holds at most max_clients_per_uid (32) sessions; another uid gets in and
    may fill the rest but for the 2 slots kept for root and the server's own
    uid, where root's client and `pleserver stats` get in; the refusal is
    ``TooManyClients``, and the plugin's reconnect retries a full server
    within its window until a slot frees."""
    server_user, hog_user, other = users[0]
    server = start_server(
        public / "model",
        "--allow-uid",
        str(hog_user.uid),
        "--allow-uid",
        str(other.uid),
        "--idle-timeout-s",
        "1",
        socket_path=str(socket_dir / "ple.sock"),
        user=server_user,
    )
    hog = python_child(HOG, server.socket, "64", "keepalive", user=hog_user, stdin=subprocess.PIPE)
    second = worker = None
    try:
        took = _report(hog)
        assert took["channels"] == 31 and took["refused"] == 33 and took["rows"] == 1, took
        assert took["first_refusal"] == (
            f"TooManyClients: uid {hog_user.uid} already holds 32 sessions on this ple-server "
            "(max_clients_per_uid = 32); close idle clients of this uid, or raise "
            "max_clients_per_uid"
        )
        time.sleep(1.5)  # past idle_timeout_s: the session kept alive keeps its slot

        # Another allowed uid is served, and may take all but the reserved slots.
        second = python_child(HOG, server.socket, "64", "-", user=other, stdin=subprocess.PIPE)
        rest = _report(second)
        assert rest["channels"] == 31 and rest["rows"] == 1, rest  # 64 - 2 - 31
        assert rest["first_refusal"] == (
            "TooManyClients: ple-server already has 63 sessions (max_clients = 64, plus one "
            "for `pleserver stats`, the other 2 kept for root and the server's own uid); "
            "close idle clients or raise max_clients"
        ), rest

        # Root: a client with a channel, and `pleserver stats`, beside it.
        with server.client(capacity=16, depth=1) as mine:
            assert mine.lookup(3, [1, 2]).shape == (2, 320)
            cli = subprocess.run(
                [sys.executable, "-m", "pleserver.cli", "stats", "--json"],
                env={**os.environ, "PLE_SERVER_SOCKET": server.socket},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert cli.returncode == 0, cli.stderr
            stats = json.loads(cli.stdout)
        # (the sessions, `pleserver stats`' own not counted)
        assert stats["clients"] == 32 + 31 + 1 and stats["channels"] == 31 + 31 + 1, stats
        assert stats["refused"]["uid_limit"] == 33, stats["refused"]
        assert stats["refused"]["too_many_clients"] == 33, stats["refused"]

        # The plugin as the second uid, on the server full for it: a worker's
        # first connect and a reconnect retry within VLLM_PLE_SHM_RECONNECT_S
        # until one of the uid's own clients closes.
        def refused() -> int:
            return PleClient.query_stats(server.socket)["refused"]["too_many_clients"]

        spec = json.dumps([other.uid, other.gid, list(other.groups)])
        worker = python_child(
            PLUGIN_RECONNECT,
            spec,
            env={
                "VLLM_PLE_SHM_SOCKET": server.socket,
                "VLLM_PLE_SHM_RECONNECT_S": "60",
                "VLLM_PLE_SHM_FALLBACK_S": "off",
            },
        )
        for what, left in (("starting", 30), ("reconnecting", 29)):
            before = refused()
            line = worker.stdout.readline()
            assert line == what + "\n", line + worker.stderr.read()
            assert wait_until(lambda b=before: refused() >= b + 3 or worker.poll() is not None, 30)
            assert worker.poll() is None, worker.communicate()  # it gave up at once
            second.stdin.write("free\n")
            second.stdin.flush()
            assert _report(second) == {"channels": left}
            result = _report(worker)
            assert result.get("rows") == 3, (what, result)  # in, once a slot freed
        _out, err = worker.communicate(timeout=60)
        assert "has no room yet" in err and "reconnected to ple-server" in err, err[-3000:]
        hog.stdin.close()
        assert _report(hog) == {"keepalive_lost": []}  # held its slot throughout
    finally:
        for child in (hog, second, worker):
            if child is None:
                continue
            if child.stdin is not None and not child.stdin.closed:
                child.stdin.close()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    assert server.running


def test_a_hot_set_that_cannot_be_saved_shows_in_stats_and_metrics_with_its_fix(
    start_server, users, public, socket_dir
):
    server_user = users[0][0]
    state = public / "state-unsaved"
    state.mkdir()
    os.chown(state, server_user.uid, server_user.gid)
    os.chmod(state, 0o750)
    try:
        server = start_server(
            public / "model",
            "--io",
            "direct",
            "--state-dir",
            str(state),
            "--hotset-save-interval",
            "0.2",
            "--metrics-address",
            "127.0.0.1:0",
            socket_path=str(socket_dir / "ple.sock"),
            user=server_user,
        )
        metrics = re.search(r"metrics on (http://\S+/metrics)", server.log())
        assert metrics, server.log()

        def failing() -> float:
            with urllib.request.urlopen(metrics.group(1), timeout=10) as response:
                text = response.read().decode()
            return float(re.search(r"^ple_hotset_save_failing (\S+)$", text, re.M).group(1))

        os.chmod(state, 0o550)  # the server's own directory, no longer writable by it
        assert wait_until(lambda: failing() == 1.0, timeout=30)
        stats = PleClient.query_stats(server.socket)["hotset"]
        assert stats["save_failures"] >= 1
        assert (
            f"uid {server_user.uid} (the server's user) may not write {state}"
            in (stats["save_error"])
        )
        text = subprocess.run(
            [sys.executable, "-m", "pleserver", "stats", "--socket", server.socket],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "hot set NOT SAVED (" in text and "Permission denied" in text, text
        os.chmod(state, 0o750)  # fixed: the next save succeeds, and says so
        assert wait_until(lambda: failing() == 0.0, timeout=30)
        assert "hot set: saved" in server.log() and (state / "hotset.bin").exists()
    finally:
        shutil.rmtree(state)
