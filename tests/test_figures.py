"""The documentation's figures (``docs/figures/make.py``, ``make figures``):
made from the recorded results in ``docs/figures/data/``, valid SVG, the same
bytes from the same data, and committed as made, so a figure can never drift
from its data. Each test runs the script as ``make figures`` does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.harness import REPO

FIGURES_DIR = REPO / "docs" / "figures"
DATA = FIGURES_DIR / "data"
FIGURES = [
    "architecture.svg",
    "memory.svg",
    "lookup-latency.svg",
    "northstar-steps.svg",
    "northstar-ratios.svg",
]
SVG = "{http://www.w3.org/2000/svg}"


def make(out: Path, data: Path = DATA, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(FIGURES_DIR / "make.py"),
            "--data",
            str(data),
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def texts(svg_file: Path) -> list[str]:
    return [t.text or "" for t in ET.parse(svg_file).getroot().iter(f"{SVG}text")]


def test_the_committed_figures_are_what_the_recorded_data_make(tmp_path):
    result = make(tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FIGURES)
    for name in FIGURES:
        assert (tmp_path / name).read_bytes() == (FIGURES_DIR / name).read_bytes(), (
            f"docs/figures/{name} differs from what docs/figures/data makes: run `make figures`"
        )
    # No figure is committed that the script no longer makes.
    assert sorted(p.name for p in FIGURES_DIR.glob("*.svg")) == sorted(FIGURES)


def test_every_figure_is_valid_svg_with_a_title_size_and_drawing(tmp_path):
    assert make(tmp_path).returncode == 0
    for name in FIGURES:
        root = ET.parse(tmp_path / name).getroot()
        assert root.tag == f"{SVG}svg", name
        width, height = float(root.attrib["width"]), float(root.attrib["height"])
        assert width > 0 and height > 0
        assert root.attrib["viewBox"] == f"0 0 {root.attrib['width']} {root.attrib['height']}"
        title = root.find(f"{SVG}title")
        assert title is not None and title.text, f"{name} has no title"
        shapes = [e for e in root.iter() if e.tag[len(SVG) :] in ("rect", "line", "polyline")]
        assert len(shapes) >= 20, f"{name}: {len(shapes)} shapes"
        assert sum(1 for t in texts(tmp_path / name) if t.strip()) >= 8, name
        # Every arrow points at a marker that is defined.
        ids = {e.attrib["id"] for e in root.iter() if "id" in e.attrib}
        for e in root.iter():
            if "marker-end" in e.attrib:
                assert e.attrib["marker-end"][len("url(#") : -1] in ids


def test_the_same_data_make_the_same_bytes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert make(one).returncode == 0
    assert make(two).returncode == 0
    for name in FIGURES:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def test_the_figures_follow_their_data(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DATA, data)
    lookup = json.loads((data / "lookup.json").read_text())
    lookup["sizes"]["16"]["pleserver-1f"]["p50_us"] = 99.9
    (data / "lookup.json").write_text(json.dumps(lookup))
    northstar = json.loads((data / "northstar-1.json").read_text())
    case = next(c for c in northstar["cases"] if c["key"].startswith("decode L16 b32 "))
    runs = {r["path"]: r for r in case["runs"]}
    a_steady = runs["a"]["windows"]["steady"]["mean"]
    runs["d"]["windows"]["steady"]["mean"] = 3 * a_steady
    runs["e"]["windows"]["whole"]["mean"] = 2.5 * runs["a"]["windows"]["whole"]["mean"]
    (data / "northstar-1.json").write_text(json.dumps(northstar))
    memory = json.loads((data / "memory.json").read_text())
    memory["scenarios"][0]["parts"][1]["gib"] = 50
    (data / "memory.json").write_text(json.dumps(memory))

    before, after = tmp_path / "before", tmp_path / "after"
    assert make(before).returncode == 0
    assert make(after, data).returncode == 0
    assert "p50 99.9 µs at 16 rows, 20.4 ms at 131 072" in texts(after / "lookup-latency.svg")
    steady_d = f"steady {3 * a_steady:.2f} ms (3.000 × a)"
    assert any(t.startswith(steady_d) for t in texts(after / "northstar-steps.svg"))
    assert "2.500" in texts(after / "northstar-ratios.svg")
    assert "PLE table 50 GiB" in texts(after / "memory.svg")
    assert "weights + KV cache 65 GiB" in texts(after / "memory.svg")  # 121 − 6 − 50
    for name in ("lookup-latency.svg", "northstar-steps.svg", "northstar-ratios.svg", "memory.svg"):
        assert (before / name).read_bytes() != (after / name).read_bytes(), name
    assert (before / "architecture.svg").read_bytes() == (after / "architecture.svg").read_bytes()


def test_memory_that_does_not_fit_the_host_is_an_error_naming_the_bar(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DATA, data)
    memory = json.loads((data / "memory.json").read_text())
    memory["scenarios"][1]["parts"][1]["gib"] = 130
    (data / "memory.json").write_text(json.dumps(memory))
    result = make(tmp_path / "out", data)
    assert result.returncode != 0
    assert (
        "vLLM alone, BF16 table: its parts add up to 136 GiB, more than the host's 121 GiB"
        in result.stderr
    )


def test_check_names_a_figure_out_of_date_and_writes_nothing(tmp_path):
    assert make(tmp_path).returncode == 0
    assert make(tmp_path, DATA, "--check").returncode == 0
    stale = tmp_path / "memory.svg"
    stale.write_text(stale.read_text().replace("121 GiB", "128 GiB"))
    result = make(tmp_path, DATA, "--check")
    assert result.returncode == 1
    assert "out of date: memory.svg; run `make figures`" in result.stderr
    assert "128 GiB" in stale.read_text()


def test_every_figure_is_shown_in_the_docs():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    shown = "\n".join(p.read_text() for p in pages)
    for name in FIGURES:
        assert f"figures/{name})" in shown, f"{name} is in no page"
