"""deploy/monitoring/: the alert rules through ``promtool check rules`` and
``promtool test rules`` (every alert on recorded series), the dashboard's
queries through promtool's parser, every query, and every series name in the
docs, naming a series a real server exports (scraped here in both kinds of io
mode), and the PodMonitor selecting the DaemonSet's metrics port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_ops_metrics import NOT_YET_REPORTED, Scrape, metrics_url, serve_in_mode

REPO = Path(__file__).resolve().parent.parent
MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "ple-server.rules.yaml"
DASHBOARD = MONITORING / "ple-server.dashboard.json"
RULES_TEST = Path(__file__).resolve().parent / "monitoring" / "rules-test.yaml"
SERIES = re.compile(r"\b((?:ple|process)_[a-z0-9_]+|up)\b(?!\s*\()")
"""A series name in a PromQL expression (``up`` included; not a function name)."""
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$instance": ".*"}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    return found


def rule_spec() -> dict:
    doc = yaml.safe_load(RULES.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    return doc["spec"]


def alerts() -> list[dict]:
    return [rule for group in rule_spec()["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]
    queries += [
        v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)
    ]
    return queries


def as_promql(query: str) -> str:
    """A dashboard query with Grafana's variables filled in; label_values() as
    the series it reads."""
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    match = re.fullmatch(r"label_values\((\w+), *\w+\)", query)
    return match.group(1) if match else query


def run(*command: str, cwd: Path) -> str:
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_the_alert_rules_pass_promtool_and_their_tests_on_recorded_series(tmp_path):
    tool = promtool()
    # The test file names the plain rules file: the PrometheusRule's spec.
    (tmp_path / "ple-server.rules.yml").write_text(yaml.safe_dump(rule_spec(), sort_keys=False))
    shutil.copy(RULES_TEST, tmp_path / "rules-test.yaml")
    checked = run(tool, "check", "rules", "ple-server.rules.yml", cwd=tmp_path)
    assert f"SUCCESS: {len(alerts())} rules found" in checked, checked
    tested = run(tool, "test", "rules", "rules-test.yaml", cwd=tmp_path)
    assert "SUCCESS" in tested, tested


def test_every_alert_is_tested_firing_and_silent():
    cases = [
        case
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test["alert_rule_test"]
    ]
    for rule in alerts():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']} is never seen firing"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']} is never seen silent"
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_every_alert_links_its_section_of_the_runbook():
    runbook = (Path(__file__).resolve().parent.parent / "docs" / "RUNBOOK.md").read_text()
    sections = {m.lower() for m in re.findall(r"^## (\w+)$", runbook, re.MULTILINE)}
    for rule in alerts():
        url = rule["annotations"].get("runbook_url", "")
        assert url == f"docs/RUNBOOK.md#{rule['alert'].lower()}", (rule["alert"], url)
        assert rule["alert"].lower() in sections, f"docs/RUNBOOK.md has no {rule['alert']}"
    assert sections == {rule["alert"].lower() for rule in alerts()}  # no stale section


def test_the_dashboard_queries_parse(tmp_path):
    """promtool parses each query (as a recording rule) with Grafana's
    variables filled in."""
    tool = promtool()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": as_promql(q)}
                    for i, q in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    checked = run(tool, "check", "rules", "dashboard.yml", cwd=tmp_path)
    assert f"SUCCESS: {len(dashboard_queries())} rules found" in checked, checked


def test_the_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "ple-server" and dash["title"] == "ple-server"
    ids = [panel["id"] for panel in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "instance"}


def scrapes(start_server, checkpoint, tmp_path) -> list[Scrape]:
    """A real server's scrape in each kind of io mode: the row cache's series
    (direct), and the page cache's (mmap)."""
    out = []
    for io in ("direct", "mmap"):
        server = serve_in_mode(start_server, checkpoint, io, tmp_path / io)
        out.append(Scrape(metrics_url(server)))
    return out


def test_every_query_names_a_series_a_real_server_exports(start_server, checkpoint, tmp_path):
    exported = {"up"}  # Prometheus' own, per target
    for scrape in scrapes(start_server, checkpoint, tmp_path):
        exported |= {name for name, _ in scrape.samples}
        exported |= set(scrape.families)
    queries = [rule["expr"] for rule in alerts()] + dashboard_queries()
    named = {name for query in queries for name in SERIES.findall(query)}
    assert named, "no series found in the queries"
    assert named <= exported | NOT_YET_REPORTED, sorted(named - exported - NOT_YET_REPORTED)
    # Every alert the brief lists has a query over its series.
    for wanted in (
        "up",
        "ple_errors_total",
        "ple_server_time_seconds_bucket",
        "ple_disk_read_errors_total",
        "ple_prewarm_state",
        "ple_sessions_refused_total",
        "ple_channels_refused_total",
        "ple_hints_dropped_total",
    ):
        assert any(wanted in SERIES.findall(rule["expr"]) for rule in alerts()), wanted


# Where an operator reads series names: the READMEs, docs/, and deploy/'s
# files (the rules' and the dashboard's descriptions, comments in the config
# and the manifests).
DOCS = ("README.md", "docs/*.md", "deploy/**/*.md", "deploy/**/*.yaml", "deploy/**/*.json")
DOCS += ("deploy/config.toml", "deploy/systemd/*")
DOC_NAME = re.compile(
    r"(?<![\w.:/-])((?:ple|process|python)_[a-z0-9_]*[a-z0-9])(_?\*)?(?![\w(-]|\.\w)"
)
"""A series name in prose or PromQL: not a call (``name(``), nor part of a
dotted path or of a C++ name (``vllm::ple_shm_lookup``); ``ple_hints_*``
names every series that starts so."""
NOT_SERIES = {
    "ple_gate": "vLLM's Triton kernel (docs/VLLM.md)",
    "ple_conv": "vLLM's Triton kernel (docs/VLLM.md)",
    "ple_layer_ids": "a key of the model's config.json (docs/DESIGN.md)",
    "ple_embedding_dtype": "a key of the model's config.json (docs/VLLM.md)",
    "process_weights_after_loading": "a method of vLLM's layers (docs/VLLM.md)",
}
"""Names the docs cite that are no series and that the native code does not
define (its functions, which docs/NATIVE.md cites, are told apart by reading it)."""
SYSCALLS = {"process_vm_readv", "process_vm_writev"}
"""System calls deploy/kubernetes/README.md names (the seccomp profile refuses
them); the profile itself (deploy/kubernetes/seccomp/) is no doc of series."""


def names_in_docs() -> dict[str, list[str]]:
    """Every series-like name the docs hold, with where (``file:line``)."""
    native = " ".join(
        p.read_text() for p in sorted(REPO.glob("pl*/native/*")) if p.suffix in (".c", ".h")
    )
    found: dict[str, list[str]] = {}
    files = sorted(
        {
            p
            for pattern in DOCS
            for p in REPO.glob(pattern)
            if p.is_file() and "seccomp" not in p.parts
        }
    )
    assert len(files) > 10, files
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name, star in DOC_NAME.findall(line):
                if name in NOT_SERIES or name in SYSCALLS or re.search(rf"\b{name}\b", native):
                    continue
                key = name + ("_*" if star else "")
                found.setdefault(key, []).append(f"{path.relative_to(REPO)}:{number}")
    return found


def test_the_docs_name_no_series_a_real_server_does_not_export(start_server, checkpoint, tmp_path):
    """Every name of a series in the docs is one a real server exports (a
    counter by its ``_total`` series, a histogram by its name or its
    ``_bucket``/``_sum``/``_count``); a ``prefix_*`` matches some. The docs once
    cited ``ple_uptime_seconds``, which no server ever exported."""
    exported = set(NOT_YET_REPORTED)
    for scrape in scrapes(start_server, checkpoint, tmp_path):
        exported |= {name for name, _ in scrape.samples}
        exported |= {n for n, f in scrape.families.items() if f.type in ("histogram", "summary")}
    named = names_in_docs()
    assert len(named) > 20, sorted(named)  # the reader finds the metrics tables' names
    unknown = {
        name: places
        for name, places in named.items()
        if not (
            any(e.startswith(name[:-1]) for e in exported)
            if name.endswith("*")
            else name in exported
        )
    }
    assert not unknown, "the docs name series no server exports: " + "; ".join(
        f"{name} ({', '.join(places)})" for name, places in sorted(unknown.items())
    )
    for name, what in NOT_SERIES.items():  # each one still cited, and still no series
        assert name in " ".join(p.read_text() for p in REPO.glob("docs/*.md")), (name, what)
        assert name not in exported, (name, what)


def test_the_pod_monitor_scrapes_the_daemonsets_metrics_port():
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor"
    (daemonset,) = [
        doc
        for doc in yaml.safe_load_all((REPO / "deploy/kubernetes/ple-server.yaml").read_text())
        if doc and doc["kind"] == "DaemonSet"
    ]
    pod = daemonset["spec"]["template"]
    assert monitor["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # job="ple-server", which the rules' PleServerDown and the dashboard ask for.
    assert pod["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "ple-server"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    server = pod["spec"]["containers"][0]
    assert endpoint["port"] in [port["name"] for port in server["ports"]]
    assert endpoint["path"] == "/metrics"
