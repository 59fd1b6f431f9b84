"""deploy/kubernetes/: the manifests against the Kubernetes schemas (offline,
the schemas bundled with kubernetes-validate), the ConfigMap through the
config loader, the memory figure against the documented formula, and the
readiness probe's command against a real server."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pleclient import protocol as p
from pleserver.config import load_config, parse_size

KUBE = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBE.glob("*.yaml"))
# The oldest Kubernetes still commonly run, and the newest the package knows.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
PROCESS_OVERHEAD = 512 << 20  # deploy/kubernetes/README.md, "Memory"
ROW_BYTES = 320  # BF16 rows: the widest the formula's example assumes


def documents() -> list[tuple[str, dict]]:
    return [
        (path.name, doc)
        for path in MANIFESTS
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def find(kind: str) -> dict:
    (doc,) = [doc for _, doc in documents() if doc["kind"] == kind]
    return doc


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]


@pytest.fixture(scope="module")
def server_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("kube") / "config.toml"
    path.write_text(find("ConfigMap")["data"]["config.toml"])
    return load_config(str(path)).config


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "name,doc",
    documents(),
    ids=lambda v: v if isinstance(v, str) else v.get("kind") if isinstance(v, dict) else None,
)
def test_manifest_validates_against_the_kubernetes_schema(name, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_misspelled_field():
    """The check above can fail: a field the schema does not know is an error."""
    daemonset = copy.deepcopy(find("DaemonSet"))
    pod_spec(daemonset)["containers"][0]["readinesProbe"] = pod_spec(daemonset)["containers"][0][
        "readinessProbe"
    ]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def test_config_map_is_a_valid_config_whose_socket_the_pods_share(server_config):
    daemonset, vllm = find("DaemonSet"), find("Pod")
    socket_dir = server_config.socket.rsplit("/", 1)[0]
    for doc in (daemonset, vllm):
        spec = pod_spec(doc)
        assert not spec.get("hostIPC") and not spec.get("hostPID")
        (volume,) = [v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == socket_dir]
        mounts = [
            m for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == volume["name"]
        ]
        assert [m["mountPath"] for m in mounts] == [socket_dir]
    # The vLLM pod's uid is one the server admits.
    assert pod_spec(vllm)["securityContext"]["runAsUser"] in server_config.allow_uids
    # The server reads its config from the ConfigMap's mount.
    server = pod_spec(daemonset)["containers"][0]
    config_mount = next(m for m in server["volumeMounts"] if m["name"] == "config")
    assert server["args"] == ["serve", "--config", f"{config_mount['mountPath']}/config.toml"]
    # The model directory the config names is mounted read-only.
    model_mount = next(m for m in server["volumeMounts"] if m["name"] == "models")
    assert server_config.model.startswith(model_mount["mountPath"] + "/")
    assert model_mount["readOnly"] is True


def test_memory_request_and_limit_follow_the_documented_formula(server_config):
    resources = pod_spec(find("DaemonSet"))["containers"][0]["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    layout = p.ChannelLayout(p.DEFAULT_DEPTH, p.DEFAULT_CAPACITY, ROW_BYTES)
    # The memory the tables take is fixed by the config, not by what is free.
    held = (
        server_config.cache_size
        if server_config.io in ("direct", "buffered")
        else server_config.prewarm_budget
    )
    assert held is not None, "set cache_size (or, for io = mmap, prewarm_budget)"
    needed = held + server_config.max_clients * layout.size + PROCESS_OVERHEAD
    limit = parse_size(resources["limits"]["memory"].removesuffix("i"))
    assert limit == math.ceil(needed / 2**30) * 2**30, (limit, needed)


def probe_command(kind: str, socket: str) -> list[str]:
    """The probe's command, with the image's pleserver replaced by this checkout's."""
    server = pod_spec(find("DaemonSet"))["containers"][0]
    command = server[kind]["exec"]["command"]
    assert command[0] == "/opt/ple-server/bin/pleserver"
    assert command[1:] == ["stats", "--socket", "/run/ple-server/ple.sock"]
    return [sys.executable, "-m", "pleserver.cli", "stats", "--socket", socket]


@pytest.mark.parametrize("kind", ["readinessProbe", "livenessProbe"])
def test_the_probe_passes_on_a_serving_server_and_fails_without_one(kind, server, tmp_path):
    ok = subprocess.run(
        probe_command(kind, server.socket), capture_output=True, text=True, timeout=30
    )
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run(
        probe_command(kind, str(tmp_path / "none.sock")), capture_output=True, text=True, timeout=30
    )
    assert missing.returncode != 0 and "not found" in missing.stderr
