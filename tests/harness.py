"""Tools for the tests; their fixtures are in ``tests/conftest.py``.

- ``footprint(pid)``: what a process holds (fds, threads, RSS, channel segments
  mapped), to check that sessions leave nothing behind;
- ``Bystander``: a well-behaved client in a thread, checking every row;
- ``RawSession``: the control protocol by hand, for hostile and half-finished
  clients;
- ``python_child``: a Python child process running a snippet, optionally as
  another uid (it drops privileges itself after its imports — the equivalent of
  ``setpriv --reuid --regid --init-groups``, which also works when the
  interpreter lives where the other uid may not read);
- ``server_launcher``: how the tests start ``pleserver serve``
  (``pleserver.devkit.launcher``): as another uid, under a command prefix
  (``prlimit``, ``unshare``) or on a chosen socket path; ``shm_env``: a vLLM
  worker's environment for a server;
- ``wait_until``: poll a condition the tests cannot be told about;
- ``other_users``: system users and a group for the access-control tests,
  created with ``useradd``/``groupadd`` and removed afterwards (root only).
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pleclient import protocol as p
from pleserver.devkit.launcher import LaunchedServer, ServerLauncher

REPO = Path(__file__).resolve().parent.parent


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


# ------------------------------------------------------------------ footprints
@dataclass(frozen=True)
class Footprint:
    fds: int
    threads: int
    rss_kib: int
    segments: int  # channel segments mapped (memfds named ple.<pid>.<session>)


def footprint(pid: int) -> Footprint:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/maps") as f:
        segments = {
            line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
            for line in f
            if "/memfd:ple." in line
        }
    return Footprint(
        len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")), rss, len(segments)
    )


def settles_to(pid: int, baseline: Footprint, timeout: float = 10.0) -> Footprint:
    """Wait until ``pid`` holds no more fds, threads or segments than
    ``baseline`` (a closed session's channel is unmapped once no gather
    worker holds it); the last footprint seen."""
    last = footprint(pid)

    def settled() -> bool:
        nonlocal last
        last = footprint(pid)
        return (
            last.fds <= baseline.fds
            and last.threads <= baseline.threads
            and last.segments <= baseline.segments
        )

    wait_until(settled, timeout)
    return last


def quiet_footprint(pid: int, timeout: float = 10.0, segments: int | None = None) -> Footprint:
    """A footprint once two samples a waiter slice apart agree (sessions that
    were closing have finished) — and, given ``segments``, once that many
    channels are mapped — as a baseline."""
    last = footprint(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = footprint(pid)
        if (now.fds, now.threads, now.segments) == (
            last.fds,
            last.threads,
            last.segments,
        ) and segments in (None, now.segments):
            return now
        last = now
    return last


def no_growth(baseline: Footprint, now: Footprint) -> bool:
    return (
        now.fds <= baseline.fds
        and now.threads <= baseline.threads
        and now.segments <= baseline.segments
    )


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: ``kill`` returns before
    a process running on another CPU has taken the signal."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")

    assert wait_until(stopped, timeout, interval=0.005), f"pid {pid} did not stop"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shm_entries() -> set[str]:
    """Every ple name in /dev/shm (segments and semaphores alike)."""
    return {n for n in os.listdir("/dev/shm") if "ple" in n}


# ---------------------------------------------------------------- bystander
class Bystander:
    """A well-behaved client in a thread, checking every row it gets."""

    def __init__(self, server, references, pause_s: float = 0.0) -> None:
        self.client = server.client(name="bystander")
        self.references = references
        # A pause between lookups longer than the server's spin (spin_us) lets
        # the server sleep beside the bystander: the window some attacks need.
        self.pause_s = pause_s
        self.lookups = 0
        self.worst_s = 0.0
        self.failure: BaseException | None = None
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = np.random.default_rng(99)
        try:
            while not self._stop.is_set():
                layer = int(rng.choice([1, 3]))
                ref = self.references[layer]
                ids = rng.integers(0, ref.shape[0], int(rng.choice([1, 300, 5000])))
                started = time.monotonic()
                rows = self.client.lookup(layer, ids)
                self.worst_s = max(self.worst_s, time.monotonic() - started)
                assert np.array_equal(rows, ref[ids]), "a row differs from the checkpoint"
                with self._progress:
                    self.lookups += 1
                    self._progress.notify_all()
                if self.pause_s:
                    self._stop.wait(self.pause_s)
        except BaseException as exc:  # reported by __exit__
            with self._progress:
                self.failure = exc
                self._progress.notify_all()

    def wait_for_lookups(self, count: int, timeout: float = 30.0) -> None:
        """Until ``count`` lookups more than now were answered and checked: the
        window in which the bystander is served beside whatever the test does."""
        with self._progress:
            target = self.lookups + count
            assert self._progress.wait_for(
                lambda: self.lookups >= target or self.failure is not None, timeout
            ), f"the bystander made {self.lookups} of {target} lookups in {timeout} s"

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.close()
        if exc[0] is None:
            assert self.failure is None, f"the bystander failed: {self.failure!r}"
            assert self.lookups > 0


# ------------------------------------------------------------ raw sessions
class RawSession:
    """The control protocol by hand: any bytes, any message, read what comes."""

    def __init__(self, path: str, timeout: float = 2.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, msg: dict, fds: list[int] | None = None) -> None:
        p.send_message(self.sock, msg, fds)

    def recv(self) -> tuple[dict | None, list[int]]:
        """One message (None once the server closed the session)."""
        try:
            return p.recv_message(self.sock)
        except (ConnectionResetError, BrokenPipeError):
            return None, []

    def hello(self) -> dict:
        self.send(
            {"type": "hello", "version": p.PROTOCOL_VERSION, "pid": os.getpid(), "name": "raw"}
        )
        msg, _ = self.recv()
        assert msg is not None and msg["type"] == "welcome", msg
        return msg

    def open_channel(self, **fields) -> tuple[dict, list[int]]:
        self.send({"type": "open_channel", **fields})
        return self.recv()

    def closed_by_server(self, timeout: float = 5.0) -> bool:
        """Read (and drop) whatever comes until the server closes the session;
        False if it is still open after ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                data, ancdata, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(64))
                for _level, _kind, cdata in ancdata:  # close any fd we were handed
                    for i in range(0, len(cdata) - len(cdata) % 4, 4):
                        os.close(int.from_bytes(cdata[i : i + 4], "little"))
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
        return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------- child processes
@dataclass(frozen=True)
class OtherUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def as_env(self) -> dict[str, str]:
        return {"PLE_TEST_AS": json.dumps([self.uid, self.gid, list(self.groups)])}


PRELUDE = """\
import ctypes, json, os, signal, socket, sys, time
import numpy as np, numpy.random
from pleclient import PleClient, PleError, ServerGone, protocol as p
from pleclient.channel import ChannelMap
from pleserver.devkit.synthetic import read_reference  # imported before a privilege drop

def _become(spec):
    uid, gid, groups = json.loads(spec)
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, as after an exec
    with open("/proc/self/status") as f:
        caps = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    assert os.geteuid() == uid and os.getegid() == gid and int(caps, 16) == 0, caps

if os.environ.get("PLE_TEST_AS"):
    _become(os.environ["PLE_TEST_AS"])
"""

SERVER_MAIN = (
    """\
from pleserver import cli, config, server
from pleserver.data import serving, tables
from pleserver.observe import metrics, metrics_http, stats
from pleserver.ops import systemd
import encodings.idna  # the metrics address is resolved after the drop
from pleclient import checkpoint
"""
    + PRELUDE
    + """
sys.exit(cli.main(sys.argv[1:]))
"""
)


def child_env(user: OtherUser | None = None, env: dict | None = None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "PLE_TEST_AS"}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out.update(user.as_env() if user else {})
    out.update(env or {})
    return out


def python_child(
    code: str, *args: str, user: OtherUser | None = None, env: dict | None = None, **popen
) -> subprocess.Popen:
    """Run ``code`` (after ``PRELUDE``) in a child Python; text pipes by default."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    popen.setdefault("text", True)
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
        cwd=REPO,
        env=child_env(user, env),
        **popen,
    )


def run_child(
    code: str, *args: str, timeout: float = 60.0, **kwargs
) -> subprocess.CompletedProcess:
    child = python_child(code, *args, **kwargs)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise AssertionError(f"child did not finish in {timeout} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def child_report(result: subprocess.CompletedProcess) -> dict:
    """The JSON object a child printed last."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, (
        f"child printed no report (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
    return json.loads(lines[-1])


# ------------------------------------------------------------------- servers
def server_launcher(
    model: Path,
    *extra: str,
    socket_path: str | None = None,
    user: OtherUser | None = None,
    prefix: tuple[str, ...] = (),
    env: dict | None = None,
) -> ServerLauncher:
    """How the tests start ``pleserver serve``: DEBUG log, from the checkout;
    as another ``user`` (``SERVER_MAIN`` drops to it after its imports), under
    a command ``prefix`` (``prlimit``, ``unshare``) or on a ``socket_path`` of
    the caller's choosing."""
    return ServerLauncher(
        model,
        *extra,
        socket_path=socket_path,
        log_level="DEBUG",
        env={**(user.as_env() if user else {}), **(env or {})},
        cwd=REPO,
        prefix=prefix,
        program=[sys.executable, "-c", SERVER_MAIN] if user else None,
    )


def shm_env(server: LaunchedServer, checkpoint: Path, **extra: str) -> dict[str, str]:
    """The environment of a vLLM worker using ``server``."""
    return {
        "VLLM_PLE_BACKEND": "shm",
        "VLLM_PLE_SHM_SOCKET": server.socket,
        "VLLM_PLE_SHM_CHECKPOINT": str(checkpoint),
        **extra,
    }


# ------------------------------------------------------------------ cgroups
@contextmanager
def child_cgroup(controller: str):
    """A cgroup of ``controller`` (``"memory"``, ``"pids"``) under this
    process's own, created for the test and removed afterwards (whatever still
    runs in it is killed first); yields its directory. cgroup v1 (the
    controller's own hierarchy) or v2 (where the controller is enabled for
    children). Skips the test where neither can be created."""
    name = f"ple-test-{os.getpid()}-{time.monotonic_ns()}"
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    path = None
    for _id, controllers, relative in lines:
        if controller in controllers.split(","):
            path = Path("/sys/fs/cgroup", controller, relative.lstrip("/"), name)
    for _id, controllers, relative in lines:
        if path is None and controllers == "":
            parent = Path("/sys/fs/cgroup", relative.lstrip("/"))
            try:
                enabled = (parent / "cgroup.subtree_control").read_text().split()
            except OSError:
                enabled = []
            if controller in enabled:
                path = parent / name
    if path is None:
        pytest.skip(f"no {controller} cgroup controller available to this process")
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a {controller} cgroup at {path}: {exc}")
    try:
        yield path
    finally:
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                for pid in (path / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), 9)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)


def cgroup_write(path: Path, v2_name: str, v1_name: str, value: str) -> None:
    """Write a setting by its cgroup v2 name, or its v1 name on v1."""
    target = path / v2_name if (path / v2_name).exists() else path / v1_name
    target.write_text(value)


def oom_kills(path: Path) -> int:
    """How many processes the kernel OOM-killed in a memory cgroup."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            for line in (path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            continue
    raise AssertionError(f"{path} reports no oom_kill count")


def in_cgroup(path: Path) -> tuple[str, ...]:
    """A command prefix that runs the command inside the cgroup ``path``."""
    return ("sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(path))


# --------------------------------------------------------------------- users
@contextmanager
def other_users(names: list[str], group: str):
    """System users ``names`` (each in its own primary group) and a shared
    supplementary ``group`` holding the first two; removed afterwards. Skips
    the test unless root with useradd."""
    if os.geteuid() != 0 or not all(
        os.path.exists(f"/usr/sbin/{tool}")
        for tool in ("useradd", "userdel", "groupadd", "groupdel")
    ):
        pytest.skip("needs root and useradd/groupadd to create users of other uids")
    created_users, created_group = [], False
    try:
        if _run_ok(["getent", "group", group]) is False:
            subprocess.run(["groupadd", "--system", group], check=True)
            created_group = True
        shared_gid = int(
            subprocess.run(
                ["getent", "group", group], capture_output=True, text=True, check=True
            ).stdout.split(":")[2]
        )
        users = []
        for i, name in enumerate(names):
            try:
                pwd.getpwnam(name)
            except KeyError:
                subprocess.run(
                    [
                        "useradd",
                        "--system",
                        "--no-create-home",
                        "--user-group",
                        "--shell",
                        "/usr/sbin/nologin",
                        *(["--groups", group] if i < 2 else []),
                        name,
                    ],
                    check=True,
                )
                created_users.append(name)
            entry = pwd.getpwnam(name)
            groups = (shared_gid,) if i < 2 else ()
            users.append(OtherUser(name, entry.pw_uid, entry.pw_gid, groups))
        yield users, shared_gid
    finally:
        for name in created_users:
            subprocess.run(["userdel", name], check=False)
        if created_group:
            subprocess.run(["groupdel", group], check=False)


def _run_ok(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


def world_readable(path: Path) -> Path:
    """Make ``path`` and everything under it readable by every uid (a checkpoint
    the other users must read; the directories above must be searchable too)."""
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return path
