"""What a user installs: the version the CLI and the reports carry, and the
license the metadata names."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import metadata, version
from pathlib import Path

import pleserver
from pleserver import doctor

REPO = Path(__file__).resolve().parent.parent


def test_version_prints_the_installed_package_version():
    out = subprocess.run(
        [sys.executable, "-m", "pleserver.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert out == f"pleserver {version('pleserver')}\n"
    assert pleserver.__version__ == version("pleserver")


def test_doctor_json_names_the_version():
    report = doctor.Report(model=None, findings={}, tables=[], advice=[]).to_json()
    assert report["version"] == version("pleserver")


def test_the_license_file_is_the_apache_license_the_metadata_names():
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text  # the full text
    assert metadata("pleserver")["License-Expression"] == "Apache-2.0"
