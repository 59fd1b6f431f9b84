"""The files an operator installs, as the package carries them.

A built package (a wheel, ``pip install .``) holds copies of deploy/'s
systemd units, sysusers.d and tmpfiles.d snippets, default config and the
configs of particular boxes (``boxes/``) under ``pleserver/deploy/``
(setup.py copies them at build time), so the service installs from a wheel
alone, with the files of the version installed:
``pleserver files`` lists them and where each one goes, ``pleserver files
--dir`` prints their folder for scripts (deploy/README.md), ``pleserver config
default`` prints the config. An editable install of a checkout reads the
checkout's deploy/ instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # pleserver/ (this module is in pleserver/ops/)
PACKAGED = PACKAGE / "deploy"
CHECKOUT = PACKAGE.parent / "deploy"


@dataclass(frozen=True)
class DeployFile:
    path: str  # under the folder, as under deploy/ in the source tree
    installs_to: str
    what: str


FILES: tuple[DeployFile, ...] = (
    DeployFile(
        "systemd/ple-server.service",
        "/etc/systemd/system/ple-server.service",
        "the systemd unit",
    ),
    DeployFile(
        "systemd/ple-server@.service",
        "/etc/systemd/system/ple-server@.service",
        "the template unit, one server per model, instead of the unit",
    ),
    DeployFile(
        "systemd/ple-server.sysusers",
        "/etc/sysusers.d/ple-server.conf",
        "user ple-server and group ple-clients, for systemd-sysusers",
    ),
    DeployFile(
        "systemd/ple-server.tmpfiles",
        "/etc/tmpfiles.d/ple-server.conf",
        "/run/ple-server at boot, for systemd-tmpfiles",
    ),
    DeployFile(
        "config.toml",
        "/etc/ple-server/config.toml",
        "the default config, every key documented: pleserver config default",
    ),
    DeployFile(
        "boxes/dgx-spark.toml",
        "/etc/ple-server/config.toml",
        "the config for a DGX Spark or GX10 (unified memory, vLLM at 0.9), instead",
    ),
)


def directory() -> Path:
    """The folder holding ``FILES``: the package's own copies, else (an
    editable install) the checkout's deploy/."""
    for folder in (PACKAGED, CHECKOUT):
        if all((folder / f.path).is_file() for f in FILES):
            return folder
    raise FileNotFoundError(
        f"the deploy files are missing from {PACKAGED}: this pleserver was "
        "installed without them; reinstall it (pip install --force-reinstall "
        "from the wheel or the source tree)"
    )


def read(path: str) -> str:
    """One of ``FILES``' text, by its ``path``."""
    if path not in {f.path for f in FILES}:
        raise KeyError(path)
    return (directory() / path).read_text()
