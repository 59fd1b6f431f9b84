"""The service under a real systemd: a stock Debian 12 booted in a container,
set up by the commands of deploy/README.md, then started, killed, wedged,
misconfigured and stopped.

The Debian root comes from ``.ci/debian-root`` (debootstrap, cached outside the
checkout); it boots with ``systemd-nspawn -b --register=no --keep-unit`` (no
systemd or D-Bus needed on the host) over a throw-away overlay
(``--volatile=overlay``), so every run starts from the same stock system. The
README's ``sh`` blocks of "Install on a fresh host" and "Several models on one
host" run verbatim inside it, in order; the test adds only what a real host
already has: the checkpoints under /models, the vLLM workers' user, and a
package source for pip (a wheelhouse built here, since the container reaches
no package index).

Needs root, ``systemd-nspawn`` and ``debootstrap`` (``apt-get install
--no-install-recommends systemd-container debootstrap``; ``.ci/run`` does).
It is not part of the default run (marker ``real_systemd``): ``make
test-systemd`` or ``.ci/run`` runs it, and there it fails, never skips, when
something is missing.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint
from tests.debian_root import debian_root, fail, wheelhouse


def real_systemd(test):
    """A test in the booted container (the first one waits for debootstrap and
    the install); the README check below runs everywhere."""
    return pytest.mark.real_systemd(pytest.mark.timeout(1200)(test))


REPO = Path(__file__).resolve().parent.parent
README = REPO / "deploy" / "README.md"
RUN_SECTIONS = ("## Install on a fresh host", "## Several models on one host")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VENV_PY = "/opt/ple-server/bin/python3"
# The checkpoints the README's examples name, and what the test puts there.
MODELS = {
    "/models/Qwen3.8-Flash-Next": (
        SyntheticTable(layer=1, rows=20_000, cols=160, dtype="F8_E4M3", parts=4),
        SyntheticTable(layer=3, rows=12_000, cols=160, parts=4),
    ),
    "/models/Qwen4-Exp": (SyntheticTable(layer=2, rows=9_000, cols=128, parts=2),),
}
INSTANCES = {"flash-next": "/models/Qwen3.8-Flash-Next", "qwen4-exp": "/models/Qwen4-Exp"}
MAX_EXPOSURE = 3.0  # systemd-analyze security: "OK" and better


# ------------------------------------------------------------ the README
def readme_commands() -> str:
    """The ``sh`` blocks of the README's install sections, dedented, in order."""
    text = README.read_text()
    blocks = []
    for heading in RUN_SECTIONS:
        start = text.index(heading)
        end = text.find("\n## ", start + len(heading))
        section = text[start : end if end >= 0 else len(text)]
        blocks += [
            textwrap.dedent(b)
            for b in re.findall(r"^[ \t]*```sh\n(.*?)^[ \t]*```$", section, re.M | re.S)
        ]
    return "\n".join(blocks)


def test_the_readme_sections_hold_the_whole_install():
    """Cheap and always run: the extraction finds every step it must run."""
    commands = readme_commands()
    for step in (
        "pip install .",
        "pleserver files --dir",
        "systemd-sysusers",
        "systemd-tmpfiles --create",
        "pleserver inspect",
        "pleserver doctor --model",
        "/etc/ple-server/config.toml",
        "config check",
        "systemctl enable --now ple-server\n",
        "pleserver stats",
        "ple-server@.service",
        "enable --now ple-server@flash-next ple-server@qwen4-exp",
    ):
        assert step in commands, f"deploy/README.md no longer runs {step!r}"
    # The units and snippets come from the package installed, not the tree.
    assert not re.search(r"(?<!\$)deploy/systemd", commands)
    # Nothing a stock Debian lacks, nothing that waits for ever.
    assert not re.search(r"^\s*(sudo )?(setfacl|curl|sudoedit)\b", commands, re.M)
    assert not re.search(r"journalctl[^\n]* -f\b", commands)


# ------------------------------------------------------------ the machine
def require_host() -> None:
    if os.geteuid() != 0:
        fail("the real-systemd test boots a container: run it as root (.ci/run does)")
    missing = [
        tool for tool in ("systemd-nspawn", "debootstrap", "nsenter") if shutil.which(tool) is None
    ]
    if missing:
        fail(
            f"missing {', '.join(missing)}: apt-get install --no-install-recommends "
            "systemd-container debootstrap (.ci/run installs them)"
        )


def debian_wheelhouse() -> Path:
    """Wheels of pleserver's build and run dependencies for the container's
    Python (Debian 12: CPython 3.11)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = project["build-system"]["requires"] + project["project"]["dependencies"] + ["wheel"]
    return wheelhouse(wanted, platform.machine())


class Machine:
    """A Debian booted under systemd-nspawn; commands enter it with nsenter."""

    def __init__(self, root: Path, binds: dict[str, str], workdir: Path) -> None:
        self.name = f"ple-ci-{os.getpid()}"
        self.log_path = workdir / "boot.log"
        args = [
            "systemd-nspawn",
            "--quiet",
            "--directory",
            str(root),
            "--boot",
            "--register=no",
            "--keep-unit",
            "--volatile=overlay",
            f"--machine={self.name}",
        ]
        args += [f"--bind={host}:{inside}" for host, inside in binds.items()]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=open(self.log_path, "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.leader = self._wait_for_leader()
        self._wait_until_booted()

    def _wait_for_leader(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                fail(f"systemd-nspawn exited ({self.proc.returncode}):\n{self.boot_log()}")
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            for pid in children.read_text().split():
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return int(pid)
            time.sleep(0.1)
        fail(f"no systemd in the container after 60 s:\n{self.boot_log()}")

    def _wait_until_booted(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            result = self.run("systemctl is-system-running --wait", check=False, timeout=120)
            if result.stdout.strip() in ("running", "degraded"):
                if result.stdout.strip() == "degraded":
                    failed = self.run("systemctl --failed --no-legend", check=False).stdout
                    fail(f"the container booted degraded:\n{failed}")
                return
            time.sleep(0.5)
        fail(f"the container did not finish booting:\n{self.boot_log()}")

    def boot_log(self) -> str:
        return self.log_path.read_bytes().decode(errors="replace")[-4000:]

    def run(
        self, script: str, *, user: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        """``script`` in bash inside the container, as root (or ``user``), from
        the source tree's root."""
        command = ["bash", "-c", "cd /root/pleserver 2>/dev/null; " + script]
        if user:
            command = [
                "setpriv",
                f"--reuid={user}",
                f"--regid={user}",
                "--init-groups",
                "--reset-env",
                "bash",
                "-c",
                f"cd /tmp; {script}",
            ]
        result = subprocess.run(
            [
                "nsenter",
                f"--target={self.leader}",
                "--all",
                "env",
                "-i",
                f"PATH={PATH}",
                "HOME=/root",
                "LANG=C.UTF-8",
                "SYSTEMD_PAGER=",
                *command,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            fail(
                f"in the container, `{script}` exited {result.returncode}:\n"
                f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
            )
        return result

    def python(self, code: str, *, user: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(f"{VENV_PY} - <<'PY'\n{textwrap.dedent(code)}\nPY", user=user, check=check)

    def show(self, unit: str) -> dict[str, str]:
        out = self.run(
            f"systemctl show {unit} -p ActiveState -p SubState -p Result "
            "-p MainPID -p NRestarts -p ExecMainStatus -p StatusText"
        ).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, unit: str, predicate, what: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        state = self.show(unit)
        while time.monotonic() < deadline:
            if predicate(state):
                return state
            time.sleep(0.5)
            state = self.show(unit)
        fail(f"{unit}: no {what} in {timeout:.0f} s; state {state}\n{self.journal(unit)}")

    def journal(self, unit: str, lines: int = 60) -> str:
        return self.run(f"journalctl -u {unit} -n {lines} --no-pager -o cat", check=False).stdout

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn: orderly poweroff of the container
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@pytest.fixture(scope="module")
def machine():
    require_host()
    root = debian_root()
    wheels = debian_wheelhouse()
    work = Path(tempfile.mkdtemp(prefix="ple-real-systemd-", dir="/var/tmp"))
    os.chmod(work, 0o755)
    try:
        # The source tree as a user's checkout holds it (tracked and new files).
        src = work / "pleserver"
        files = (
            subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=REPO,
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .split("\0")
        )
        for name in filter(None, files):
            if (REPO / name).is_file():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, src / name)
        binds = {str(src): "/root/pleserver", str(wheels): "/var/cache/ple-wheels"}
        for seed, (inside, tables) in enumerate(MODELS.items()):
            model = work / "models" / Path(inside).name
            write_checkpoint(str(model), tables, files=2, seed=seed)
            for path in [model, *model.iterdir()]:
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            binds[str(model)] = inside
        pip_conf = work / "pip.conf"
        pip_conf.write_text("[global]\nno-index = true\nfind-links = /var/cache/ple-wheels\n")
        binds[str(pip_conf)] = "/etc/pip.conf"
        box = Machine(root, binds, work)
        try:
            # What the host has before the README: the vLLM workers' user, and
            # another user who must be refused.
            box.run(
                "useradd --system --no-create-home vllm && "
                "useradd --system --no-create-home intruder"
            )
            yield box
        finally:
            box.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def installed(machine):
    """The README's commands, verbatim, in the container. Returns their output."""
    script = "set -euxo pipefail\n" + readme_commands()
    # The second section replaces ple-server.service with the template's
    # instances: run the first one, check the single service, then the second.
    first, second = script.split("sudo systemctl disable --now ple-server", 1)
    result = machine.run(first, timeout=600)
    return machine, "sudo systemctl disable --now ple-server" + second, result.stdout


CLIENT = """
import sys
import numpy as np
from pleclient import PleClient
from pleserver.devkit.synthetic import read_reference
with PleClient.connect(sys.argv[1] if len(sys.argv) > 1 else "{socket}") as client:
    for table in client.tables:
        ids = [0, 1, table.rows - 1, table.rows // 2]
        rows = client.lookup(table, ids)
        reference = read_reference("{model}", table.name)
        assert np.array_equal(rows, reference[ids]), table.name
    print("rows ok", len(client.tables))
"""


def client_code(socket: str, model: str) -> str:
    return CLIENT.replace("{socket}", socket).replace("{model}", model)


def exposure(machine: Machine, unit: str) -> float:
    out = machine.run(f"systemd-analyze security {unit} --no-pager").stdout
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out)
    assert m, out[-2000:]
    return float(m.group(1))


# ------------------------------------------------------------ the checks
@real_systemd
def test_readme_install_gives_a_ready_service_with_its_status(installed):
    machine, _, output = installed
    state = machine.show("ple-server")
    assert state["ActiveState"] == "active" and state["SubState"] == "running", state
    assert "installed" in output and "ple_server_info{" in output, output[-3000:]
    assert "doctor: OK" in output and "Recommended settings" in output, output[-3000:]
    # The status line keeps what is served while and after the prewarm.
    done = machine.wait_for(
        "ple-server", lambda s: "prewarm done" in s["StatusText"], "finished prewarm", 60
    )
    assert re.fullmatch(
        r"serving 2 tables on /run/ple-server/ple\.sock; prewarm done: "
        r"100\.0% \([0-9.]+ MiB of [0-9.]+ MiB\)",
        done["StatusText"],
    ), done
    journal = machine.journal("ple-server")
    assert journal.index("ready: serving 2 tables") < journal.index("prewarm: reading"), journal


@real_systemd
def test_an_allowed_uid_gets_rows_and_another_is_refused(installed):
    machine, _, _ = installed
    ok = machine.python(
        client_code("/run/ple-server/ple.sock", "/models/Qwen3.8-Flash-Next"), user="vllm"
    )
    assert "rows ok 2" in ok.stdout
    refused = machine.python(
        client_code("/run/ple-server/ple.sock", "/models/Qwen3.8-Flash-Next"),
        user="intruder",
        check=False,
    )
    assert refused.returncode != 0 and "may not use this ple-server" in refused.stderr, (
        refused.stderr[-2000:]
    )


def signal_and_wait_for_restart(machine, signame: str, why: str, timeout: float) -> None:
    """Send SIG``signame`` to the server; wait until systemd has restarted it, once."""
    before = machine.show("ple-server")
    machine.run(f"kill -{signame} {before['MainPID']}")
    after = machine.wait_for(
        "ple-server",
        lambda s: s["ActiveState"] == "active" and s["MainPID"] not in ("0", before["MainPID"]),
        why,
        timeout,
    )
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, after


@real_systemd
def test_sigkill_restarts_the_server(installed):
    machine, _, _ = installed
    signal_and_wait_for_restart(machine, "KILL", "restart after SIGKILL", 30)


@real_systemd
def test_a_wedged_server_is_killed_by_the_watchdog_and_restarted(installed):
    machine, _, _ = installed
    signal_and_wait_for_restart(
        machine, "STOP", "restart after the watchdog timeout (WatchdogSec=30)", 75
    )
    assert "Watchdog timeout" in machine.run("journalctl -u ple-server --no-pager").stdout


@real_systemd
def test_manual_restarts_do_not_hit_the_start_limit(installed):
    machine, _, _ = installed
    for _ in range(6):  # with the restarts above, more than StartLimitBurst=5 used to allow
        machine.run("systemctl restart ple-server")
    assert machine.show("ple-server")["ActiveState"] == "active"
    machine.python(
        client_code("/run/ple-server/ple.sock", "/models/Qwen3.8-Flash-Next"), user="vllm"
    )


# Two clients that look rows up without a pause until /tmp/load.stop appears,
# as a vLLM worker's two routes do: a CPU client that reconnects in place, and
# a GPU-driven channel (the CPU stand-in of a CUDA stream) whose watchdog has
# the next server adopt it, reading rows from the checkpoint past 1 s.
LOAD = """
import json, os, threading
import numpy as np
from pleclient import PleClient, PleError, ServerGone, ServerUnavailable
from pleclient.checkpoint import discover_tables
from pleclient.fallback import CheckpointReader
from pleclient.gpu import GpuLookups
from pleserver.devkit.synthetic import read_reference
SOCKET, MODEL = "/run/ple-server/ple.sock", "/models/Qwen3.8-Flash-Next"
refs = {t.name: read_reference(MODEL, t.name) for t in discover_tables(MODEL)}
result = {"cpu": 0, "gpu": 0, "wrong": 0, "failed": [], "reconnects": 0}
rng = np.random.default_rng(0)

def cpu():
    client = PleClient.connect(SOCKET, capacity=256, depth=2)
    while not os.path.exists("/tmp/load.stop"):
        table = client.tables[result["cpu"] % 2]
        ids = rng.integers(0, table.rows, 256)
        try:
            rows = client.lookup(table, ids)
        except (ServerGone, ServerUnavailable):
            client.reconnect(window=60)
            result["reconnects"] += 1
            continue
        result["wrong"] += not np.array_equal(rows, refs[table.name][ids])
        result["cpu"] += 1
    client.close()

def gpu():
    reader = CheckpointReader(discover_tables(MODEL))
    gl = GpuLookups.open(SOCKET, device="cpu", capacity=256, depth=2, reader=reader)
    while not os.path.exists("/tmp/load.stop"):
        table = gl.tables[result["gpu"] % 2]
        ids = rng.integers(0, table.rows, 256)
        out = np.empty((256, table.row_bytes), dtype=np.uint8)
        gl.ring(0, table, ids)
        gl.collect(0, out)
        result["wrong"] += not np.array_equal(out, refs[table.name][ids])
        result["gpu"] += 1
    result["events"] = [e["ended"] for e in gl.watchdog.events]
    result["fallback_rows"] = gl.watchdog.fallback_rows
    gl.close()

def run(body):
    try:
        body()
    except Exception as exc:
        result["failed"].append(repr(exc))

threads = [threading.Thread(target=run, args=(f,)) for f in (cpu, gpu)]
for t in threads:
    t.start()
for t in threads:
    t.join()
json.dump(result, open("/tmp/load.json", "w"))
"""


@real_systemd
def test_reload_restart_and_crash_under_running_clients_lose_no_lookup(installed):
    """The upgrade path of deploy/README.md (restart under running workers),
    a reload, and a crash that systemd restarts: the clients never see a
    failed lookup or a wrong row, and end on the server again."""
    machine, _, _ = installed
    machine.run("rm -f /tmp/load.stop /tmp/load.json")
    machine.run(
        f"nohup {VENV_PY} - > /tmp/load.log 2>&1 <<'PY' &\n{LOAD}\nPY", user="vllm", timeout=30
    )
    time.sleep(3)
    reload = machine.run("systemctl reload ple-server", check=False)
    assert reload.returncode == 0, (
        reload.stderr
        + machine.run("systemctl status ple-server --no-pager", check=False).stdout
        + machine.journal("ple-server", 40)
    )
    time.sleep(2)
    machine.run("systemctl restart ple-server")  # an upgrade's restart
    time.sleep(3)
    signal_and_wait_for_restart(machine, "KILL", "restart after SIGKILL", 30)
    time.sleep(3)
    machine.run("touch /tmp/load.stop")
    deadline = time.monotonic() + 60
    while machine.run("test -e /tmp/load.json", check=False).returncode != 0:
        assert time.monotonic() < deadline, machine.run("cat /tmp/load.log").stdout[-3000:]
        time.sleep(0.5)
    result = json.loads(machine.run("cat /tmp/load.json").stdout)
    assert result["failed"] == [] and result["wrong"] == 0, result
    assert result["cpu"] > 0 and result["gpu"] > 0, result
    assert result["reconnects"] >= 2, result  # the restart and the crash
    assert result["events"] and set(result["events"]) == {"adopted"}, result
    assert re.search(r"reload #\d+ done", machine.journal("ple-server", 400))


@real_systemd
def test_a_config_error_exits_78_without_a_restart_loop(installed):
    machine, _, _ = installed
    machine.run(
        "cp /etc/ple-server/config.toml /root/config.good && "
        "echo 'max_clients = \"many\"' >> /etc/ple-server/config.toml"
    )
    start = machine.run("systemctl restart ple-server", check=False)
    assert start.returncode != 0
    failed = machine.show("ple-server")
    assert failed["ActiveState"] == "failed" and failed["ExecMainStatus"] == "78", failed
    time.sleep(5)  # > RestartSec=2: a restart would have happened by now
    later = machine.show("ple-server")
    assert later["ActiveState"] == "failed" and later["NRestarts"] == failed["NRestarts"], later
    assert "max_clients" in machine.journal("ple-server", 20)
    # The README's way back.
    machine.run(
        "cp /root/config.good /etc/ple-server/config.toml && "
        "systemctl reset-failed ple-server && systemctl start ple-server"
    )
    assert machine.show("ple-server")["ActiveState"] == "active"


@real_systemd
def test_security_exposure_stays_low(installed):
    machine, _, _ = installed
    score = exposure(machine, "ple-server.service")
    assert score <= MAX_EXPOSURE, f"systemd-analyze security: {score} > {MAX_EXPOSURE}"


@real_systemd
def test_two_template_instances_serve_their_models_and_the_single_unit_stops_clean(installed):
    machine, second, _ = installed
    result = machine.run("set -euxo pipefail\n" + second, timeout=300)
    # `disable --now ple-server` was a clean stop.
    stopped = machine.show("ple-server")
    assert stopped["ActiveState"] == "inactive" and stopped["Result"] == "success", stopped
    assert stopped["ExecMainStatus"] == "0", stopped
    assert "stopped" in machine.journal("ple-server", 10)
    machine.run("test ! -e /run/ple-server/ple.sock")
    # Both instances run at once, each on its socket with its own model.
    for name, model in INSTANCES.items():
        state = machine.show(f"ple-server@{name}")
        assert state["ActiveState"] == "active", (name, state)
        assert state["StatusText"].startswith(
            f"serving {len(MODELS[model])} tables on /run/ple-server/{name}.sock"
        ), state
        out = machine.python(client_code(f"/run/ple-server/{name}.sock", model), user="vllm")
        assert f"rows ok {len(MODELS[model])}" in out.stdout
        machine.run(f"test -d /var/lib/ple-server/{name}")
        assert exposure(machine, f"ple-server@{name}.service") <= MAX_EXPOSURE
    assert f"model {INSTANCES['qwen4-exp']}" in result.stdout, result.stdout[-3000:]
    # The vLLM plugin's socket choice, by the checkpoint it loads.
    for name, model in INSTANCES.items():
        chosen = machine.python(
            f"""
            from pleclient.vllm_plugin.discovery import find_socket
            print(find_socket("{model}"))
        """,
            user="vllm",
        ).stdout.strip()
        assert chosen == f"/run/ple-server/{name}.sock", (model, chosen)
    # A clean stop of one instance leaves the other serving.
    machine.run("systemctl stop ple-server@qwen4-exp")
    stopped = machine.show("ple-server@qwen4-exp")
    assert stopped["ActiveState"] == "inactive" and stopped["Result"] == "success", stopped
    machine.run("test ! -e /run/ple-server/qwen4-exp.sock")
    assert machine.show("ple-server@flash-next")["ActiveState"] == "active"
