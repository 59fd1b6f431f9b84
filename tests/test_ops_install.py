"""What a user installs: the version the CLI and the reports carry, the
license the metadata names, and the wheel (marker ``wheels``: ``make wheels``
builds it and runs those), with the deploy files an operator installs from it."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import metadata, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import pleserver
from pleserver.ops import deployfiles, doctor

REPO = Path(__file__).resolve().parent.parent
MAN_PAGE = REPO / "man" / "pleserver.1"


@pytest.mark.parametrize("module", ["pleserver", "pleserver.cli"])
def test_version_prints_the_installed_package_version(module):
    out = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert out == f"pleserver {version('pleserver')}\n"
    assert pleserver.__version__ == version("pleserver")


def test_the_metadata_says_what_the_package_is_and_pins_vllm_to_its_minor_release():
    meta = metadata("pleserver")
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers and "Operating System :: POSIX :: Linux" in classifiers
    (vllm,) = [r for r in meta.get_all("Requires-Dist") or [] if r.startswith("vllm")]
    spec = Requirement(vllm).specifier
    # a 0.33 patch release is taken, never a downgrade of it, never 0.34
    assert "0.33.0" in spec and "0.33.4" in spec and "0.34.0" not in spec, vllm
    # the linters are the dev extra's: not the test extra's, which make demo's venv installs
    extras = {r.split(";")[1] for r in meta.get_all("Requires-Dist") or [] if ";" in r}
    assert any("dev" in e for e in extras)
    tests = [r for r in meta.get_all("Requires-Dist") or [] if 'extra == "test"' in r]
    assert tests and not any(r.startswith(("ruff", "mypy")) for r in tests), tests


def test_doctor_json_names_the_version():
    report = doctor.Report(model=None, findings={}, tables=[], advice=[]).to_json()
    assert report["version"] == version("pleserver")


def test_the_license_file_is_the_apache_license_the_metadata_names():
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text  # the full text
    assert metadata("pleserver")["License-Expression"] == "Apache-2.0"


# ------------------------------------------------------------ the wheel
# `make wheels` builds the wheel (.ci/build-wheel: pip wheel, auditwheel repair)
# into PLE_WHEEL_DIR and runs these; without it they build one themselves.
WHEEL_NAME = re.compile(
    r"pleserver-(?P<version>[^-]+)-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl"
)
# What the wheel's own venv runs, away from the source tree: both native
# modules import and work, from the installed abi3 files.
WHEEL_CHECK = """
import json
import pleserver
from pleclient import _sync
from pleserver import _native
words = _sync.Words(bytearray(16))
assert words.publish(0, 7, 4) is False and words.load(0) == 7
cache = _native.RowCache(1 << 20, 64, hugepages=False)
assert cache.capacity_rows > 0
cache.close()
print(json.dumps({"version": pleserver.__version__, "files": [_native.__file__, _sync.__file__]}))
"""


def check_wheel_tags(wheel: Path, machine: str) -> str:
    """The wheel's file name and WHEEL metadata say CPython ≥ 3.11 stable ABI
    on manylinux for ``machine``; returns the platform tag."""
    m = WHEEL_NAME.fullmatch(wheel.name)
    assert m, wheel.name
    assert m["version"] == version("pleserver"), wheel.name
    assert (m["python"], m["abi"]) == ("cp311", "abi3"), wheel.name
    assert re.fullmatch(rf"manylinux_2_\d+_{machine}", m["platform"]), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = z.read(f"pleserver-{m['version']}.dist-info/WHEEL").decode()
    assert f"Tag: cp311-abi3-{m['platform']}" in info.splitlines(), info
    assert f"pleserver-{m['version']}.dist-info/licenses/LICENSE" in names
    assert sorted(n for n in names if n.endswith(".so")) == [
        "pleclient/_sync.abi3.so",
        "pleserver/_native.abi3.so",
    ]
    return m["platform"]


def check_deploy_files(wheel: Path) -> None:
    """The wheel carries deploy/'s units, snippets and config, byte for byte."""
    with zipfile.ZipFile(wheel) as z:
        packed = {
            n: z.read(n)
            for n in z.namelist()
            if n.startswith("pleserver/deploy/") and not n.endswith("/")  # not folders
        }
    assert set(packed) == {f"pleserver/deploy/{f.path}" for f in deployfiles.FILES}, sorted(packed)
    for f in deployfiles.FILES:
        assert packed[f"pleserver/deploy/{f.path}"] == (REPO / "deploy" / f.path).read_bytes()


def check_installed(report: str, prefix: str) -> None:
    """What WHEEL_CHECK printed: the version, and both modules from ``prefix``."""
    out = json.loads(report.strip().splitlines()[-1])
    assert out["version"] == version("pleserver"), out
    for file in out["files"]:
        assert file.startswith(prefix + "/") and file.endswith(".abi3.so"), out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """This machine's wheel: from PLE_WHEEL_DIR, else built here."""
    folder = os.environ.get("PLE_WHEEL_DIR")
    if folder:
        found = sorted(Path(folder).glob(f"pleserver-*{platform.machine()}.whl"))
        assert found, f"no pleserver wheel for {platform.machine()} in {folder}: make wheels"
        return found[-1]
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [str(REPO / ".ci" / "build-wheel"), sys.executable, str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.mark.wheels
def test_the_wheel_is_manylinux_abi3_with_the_license(wheel):
    check_wheel_tags(wheel, platform.machine())


@pytest.mark.wheels
def test_the_wheel_carries_the_units_snippets_and_default_config(wheel):
    check_deploy_files(wheel)


@pytest.mark.wheels
def test_the_wheel_installs_the_man_page(wheel):
    with zipfile.ZipFile(wheel) as z:
        page = z.read(f"pleserver-{version('pleserver')}.data/data/share/man/man1/pleserver.1")
    assert page == MAN_PAGE.read_bytes()


@pytest.mark.wheels
def test_the_wheel_carries_its_type_hints(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for typed in ("pleserver/py.typed", "pleclient/py.typed"):
        assert typed in names, typed
    # the native modules' stubs, which the hints of the rest refer to
    assert {"pleserver/_native.pyi", "pleclient/_sync.pyi"} <= names


@pytest.mark.wheels
def test_the_wheel_installs_into_a_fresh_venv_without_a_compiler(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    # Binaries only: pip may not build anything, so no compiler is involved.
    install = subprocess.run(
        [py, "-m", "pip", "install", "-q", "--only-binary=:all:", str(wheel)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    # Away from the source tree, so the installed modules are the ones imported.
    ran = subprocess.run(
        [py, "-c", WHEEL_CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    check_installed(ran.stdout, str(venv))
    cli = subprocess.run(
        [str(venv / "bin" / "pleserver"), "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.stdout == f"pleserver {version('pleserver')}\n", cli.stderr
    # The installed files, as deploy/README.md installs them, from the venv.
    files = subprocess.run(
        [str(venv / "bin" / "pleserver"), "files", "--dir"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    folder = Path(files.stdout.strip())
    assert files.returncode == 0 and folder.is_relative_to(venv), files.stdout + files.stderr
    for f in deployfiles.FILES:
        assert (folder / f.path).read_bytes() == (REPO / "deploy" / f.path).read_bytes(), f.path
    default = subprocess.run(
        [str(venv / "bin" / "pleserver"), "config", "default"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert default.stdout == (REPO / "deploy" / "config.toml").read_text(), default.stderr
    # Completion works from the wheel's dependencies alone (argcomplete), as
    # the shells' scripts ask it: the line in the environment, the answer to
    # a file.
    answer = tmp_path / "completions"
    asked = subprocess.run(
        [str(venv / "bin" / "pleserver")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "_ARGCOMPLETE": "1",
            "COMP_LINE": "pleserver se",
            "COMP_POINT": "12",
            "_ARGCOMPLETE_STDOUT_FILENAME": str(answer),
        },
    )
    assert asked.returncode == 0 and answer.read_text().split() == ["serve"], asked.stderr
    # The man page under the venv's prefix, where man(1) looks for the
    # commands of a bin/ on the PATH.
    page = venv / "share" / "man" / "man1" / "pleserver.1"
    assert page.read_bytes() == MAN_PAGE.read_bytes()
    if shutil.which("man"):
        found = subprocess.run(
            ["man", "-w", "pleserver"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **{k: v for k, v in os.environ.items() if k != "MANPATH"},
                "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
            },
        )
        assert found.stdout.strip() == str(page), found.stdout + found.stderr
