"""deploy/kubernetes/: the manifests against the Kubernetes schemas (offline,
the schemas bundled with kubernetes-validate) and through a policy linter
(checkov), the ConfigMap through the config loader, the memory figure against
the documented formula, scheduling, QoS and privileges, and the probes' command
against a real server's health socket."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import kubernetes_validate
import numpy as np
import pytest
import yaml

from pleclient import protocol as p
from pleserver.config import load_config, parse_size
from tests.harness import wait_until
from tests.test_ops_cli import pleserver

KUBE = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# What `kubectl apply -k deploy/kubernetes/` applies, and the vLLM pod's parts.
EXAMPLES = [KUBE / "vllm-pod.yaml"]
# The oldest Kubernetes still commonly run, and the newest the package knows.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
PROCESS_OVERHEAD = 512 << 20  # deploy/kubernetes/README.md, "Memory"
ROW_BYTES = 320  # BF16 rows: the widest the formula's example assumes


def kustomize(directory: Path = KUBE) -> list[dict]:
    """The objects ``kubectl apply -k DIR`` applies (kubectl's own kustomize;
    .ci/run installs kubectl where the machine lacks it)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed (.ci/run installs it: Debian's kubernetes-client)"
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@functools.cache
def documents() -> list[tuple[str, dict]]:
    return [("kustomization", doc) for doc in kustomize()] + [
        (path.name, doc) for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text()) if doc
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
    assert path.read_text() == (KUBE / "config.toml").read_text()  # the file, as it is
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


def server_container() -> dict:
    return pod_spec(find("DaemonSet"))["containers"][0]


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


PROBES = [("startupProbe", True), ("readinessProbe", True), ("livenessProbe", False)]
DOCKERFILE = KUBE.parent / "container" / "ple-server.Dockerfile"


def probe_command(kind: str) -> list[str]:
    return server_container()[kind]["exec"]["command"]


def test_the_servers_probes_ask_its_health_socket_alone():
    """Exec probes of `pleserver health` on the ConfigMap's health_socket, in a
    directory of the pod's own: not the metrics port, which every user of the
    node can flood past its accept rate (the kubelet would then restart the
    server), nor the control socket, where a probe would take one of the
    max_clients + 1 sessions."""
    server = server_container()
    config = load_health_socket()
    (entrypoint,) = re.findall(r'^ENTRYPOINT \["([^"]+)"\]', DOCKERFILE.read_text(), re.M)
    for kind, ready in PROBES:
        assert "httpGet" not in server[kind] and "tcpSocket" not in server[kind], kind
        wanted = [entrypoint, "health", *(["--ready"] if ready else []), config]
        assert probe_command(kind) == wanted, kind
    # The socket's directory is a volume of this pod alone, mounted by the server.
    directory = config.rsplit("/", 1)[0]
    (mount,) = [m for m in server["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in pod_spec(find("DaemonSet"))["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume, volume
    for doc in (find("DaemonSet"), find("Pod")):  # and no other probe takes a session
        for container in containers(pod_spec(doc)):
            for kind, _ in PROBES:
                probe = container.get(kind)
                if probe is not None and "exec" in probe:
                    assert probe["exec"]["command"][1] == "health", (container["name"], kind)


def load_health_socket() -> str:
    path = re.search(
        r'^\s*health_socket = "([^"]+)"', find("ConfigMap")["data"]["config.toml"], re.M
    )
    assert path, "the ConfigMap sets no health_socket"
    return path.group(1)


@pytest.mark.parametrize("kind,ready", PROBES)
def test_the_probe_command_asks_a_real_server(
    kind, ready, server_config, start_server, checkpoint, tmp_path
):
    assert server_config.health_socket == load_health_socket()
    # The ConfigMap's metrics address is the metrics port, on the pod's address.
    (port,) = [p for p in server_container()["ports"] if p["name"] == "metrics"]
    assert server_config.metrics_address == f"0.0.0.0:{port['containerPort']}"
    health = str(tmp_path / "health.sock")
    command = [*probe_command(kind)[1:-1], health]  # the image's binary: this checkout's
    launched = start_server(checkpoint, "--health-socket", health)
    answered = pleserver(*command)
    assert (answered.returncode, answered.stdout) == (0, "ok\n"), answered
    launched.stop()
    # The kubelet counts a non-zero exit as a failure.
    assert pleserver(*command).returncode == 1


def test_the_startup_probe_allows_a_slow_start():
    probe = server_container()["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300


def test_the_pod_schedules_on_tainted_gpu_nodes_above_vllm():
    spec = pod_spec(find("DaemonSet"))
    assert {
        "key": "nvidia.com/gpu",
        "operator": "Exists",
        "effect": "NoSchedule",
    } in spec["tolerations"]
    priority = find("PriorityClass")
    assert spec["priorityClassName"] == priority["metadata"]["name"]
    assert 0 < priority["value"] < 1_000_000_000  # above default pods, below system classes
    assert priority["globalDefault"] is False
    assert pod_spec(find("Pod")).get("priorityClassName") is None  # vLLM: priority 0


def test_a_rolling_update_replaces_each_nodes_server_stop_then_start():
    """One node's socket has one server: the old pod stops (its in-flight
    requests finished within the grace period) before the new one starts, and
    the vLLM pods ride through (their lookups wait, then read the checkpoint
    they mount themselves, until the new server adopts their channels)."""
    daemonset = find("DaemonSet")
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 1
    assert strategy["rollingUpdate"].get("maxSurge", 0) == 0  # never two on one socket
    assert pod_spec(daemonset)["terminationGracePeriodSeconds"] >= 10
    vllm = pod_spec(find("Pod"))
    mounts = {m["mountPath"]: m for c in vllm["containers"] for m in c["volumeMounts"]}
    (model,) = [a for a in vllm["containers"][0]["command"] if a.startswith("/models/")]
    assert mounts["/models"].get("readOnly") and model.startswith("/models/")


def test_the_server_pod_is_guaranteed():
    """Every container, init containers included, with requests equal to
    limits for both CPU and memory: Kubernetes' rule for the Guaranteed class."""
    for container in containers(pod_spec(find("DaemonSet"))):
        resources = container["resources"]
        for resource in ("cpu", "memory"):
            assert resources["requests"][resource] == resources["limits"][resource], (
                container["name"],
                resource,
            )


def test_least_privilege_and_the_namespace_pod_security_label():
    namespace = find("Namespace")
    # hostPath volumes need the privileged profile; the comment says so.
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert "hostPath" in (KUBE / "ple-server.yaml").read_text().split("kind: Namespace")[1]
    for doc in (find("DaemonSet"), find("Pod")):
        spec = pod_spec(doc)
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in containers(spec):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]


def test_the_network_policy_admits_the_metrics_port_only():
    policy = find("NetworkPolicy")
    labels = pod_spec_labels(find("DaemonSet"))
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] and all("namespaceSelector" in peer for peer in rule["from"])
    (port,) = [p for p in server_container()["ports"] if p["name"] == "metrics"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port["containerPort"]}]


def pod_spec_labels(doc: dict) -> dict:
    return doc["spec"]["template"]["metadata"]["labels"]


CHECKOV_ENV = "PLE_CHECKOV"


def test_checkov_passes_every_check_it_does_not_skip_with_a_reason():
    """The policy linter (checkov, from PyPI: .ci/run installs it in a venv of
    its own and names it in $PLE_CHECKOV). Each skip is an annotation on its
    object whose value gives the reason."""
    checkov = os.environ.get(CHECKOV_ENV) or shutil.which("checkov")
    if checkov is None:
        pytest.skip(f"checkov is not installed (.ci/run installs it; or set ${CHECKOV_ENV})")
    result = subprocess.run(
        [checkov, "-d", str(KUBE), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [c for r in reports for c in r["results"]["failed_checks"]]
    assert not failed, [(c["check_id"], c["resource"], c["check_name"]) for c in failed]
    assert result.returncode == 0, result.stderr[-2000:]
    summary = reports[0]["summary"]
    assert summary["passed"] > 100 and summary["parsing_errors"] == 0, summary
    skipped = [c for r in reports for c in r["results"]["skipped_checks"]]
    for check in skipped:
        reason = check["check_result"].get("suppress_comment") or ""
        assert len(reason) > 20, (check["check_id"], check["resource"], reason)


def test_a_changed_config_is_a_new_config_map_that_rolls_the_pods(tmp_path):
    copy_dir = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy_dir)
    before = {d["kind"]: d for d in kustomize(copy_dir)}
    with open(copy_dir / "config.toml", "a") as f:
        f.write("queue_depth = 64\n")
    after = {d["kind"]: d for d in kustomize(copy_dir)}

    def referenced(objects: dict) -> str:
        volumes = pod_spec(objects["DaemonSet"])["volumes"]
        return next(v["configMap"]["name"] for v in volumes if v["name"] == "config")

    for objects in (before, after):  # the DaemonSet mounts the ConfigMap made with it
        assert referenced(objects) == objects["ConfigMap"]["metadata"]["name"]
        assert objects["ConfigMap"]["metadata"]["name"].startswith("ple-server-")
    # a new name, so a new pod template: the DaemonSet's rolling update runs
    assert referenced(before) != referenced(after)
    assert "queue_depth = 64" in after["ConfigMap"]["data"]["config.toml"]


def test_the_images_are_named_in_full():
    """Registry, path and tag: an image named in full pulls from where it was
    pushed, never from whatever registry a node defaults to."""
    for _, doc in documents():
        if doc["kind"] not in ("DaemonSet", "Pod"):
            continue
        spec = pod_spec(doc)
        for container in spec.get("initContainers", []) + spec["containers"]:
            image = container["image"]
            registry, _, rest = image.partition("/")
            assert "." in registry and "/" in rest and ":" in rest, image


# ------------------------------------------------------------- seccomp, io_uring
PROFILE = KUBE / "seccomp" / "ple-server.json"


def refused_by_profile() -> dict[str, dict]:
    """The profile's rules that refuse a syscall, by name."""
    profile = json.loads(PROFILE.read_text())
    return {
        name: rule
        for rule in profile["syscalls"]
        if rule["action"] != "SCMP_ACT_ALLOW"
        for name in rule["names"]
    }


def test_the_io_uring_component_runs_the_servers_under_the_shipped_profile(tmp_path):
    profile = json.loads(PROFILE.read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= set(profile["architectures"])
    refused = refused_by_profile()
    assert not {"io_uring_setup", "io_uring_enter", "io_uring_register"} & set(refused)
    assert {"unshare", "setns", "mount", "bpf", "ptrace", "userfaultfd", "keyctl"} <= set(refused)
    assert refused["clone3"]["errnoRet"] == 38  # ENOSYS: the C library falls back to clone
    # Enabled with one line in the kustomization, as its README says.
    copy_dir = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy_dir)
    with open(copy_dir / "kustomization.yaml", "a") as f:
        f.write("components:\n  - io-uring\n")
    (daemonset,) = [d for d in kustomize(copy_dir) if d["kind"] == "DaemonSet"]
    assert pod_spec(daemonset)["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": f"profiles/{PROFILE.name}",
    }
    for version in VERSIONS:
        kubernetes_validate.validate(daemonset, version, strict=True)


def test_the_profile_refuses_no_call_a_real_server_makes(start_server, checkpoint, tmp_path):
    """A server under strace, through what it does on a node: io_uring reads
    of misses, hints, stats, metrics, the health socket, a reload, a hot-set
    save and a stop. None of its system calls is one the profile refuses, and
    no clone asks for a namespace."""
    strace = shutil.which("strace")
    assert strace, "strace is not installed (.ci/run installs it)"
    trace = tmp_path / "trace"
    state = tmp_path / "state"
    state.mkdir(mode=0o750)
    server = start_server(
        checkpoint,
        "--io",
        "direct",
        "--read-engine",
        "io_uring",
        "--cache-size",
        "1M",
        "--state-dir",
        str(state),
        "--metrics-address",
        "127.0.0.1:0",
        "--health-socket",
        str(tmp_path / "health.sock"),
        prefix=(strace, "-f", "-qq", "-o", str(trace), "-e", "trace=all", "-e", "signal=none"),
        wait=False,  # (its readiness comes from strace's child: asked for instead)
    )
    assert wait_until(lambda: server_pid(server.socket) is not None, timeout=120), server.log()
    pid = server_pid(server.socket)
    assert pid is not None
    ended = False
    try:
        with server.client() as client:
            for n in (1, 16, 5000):
                client.lookup(1, np.arange(n) * 3 % 20_011)
            client.hint(3, np.arange(200))
            client.stats()
        assert pleserver("health", str(tmp_path / "health.sock")).returncode == 0
        metrics = re.search(r"metrics on (http://\S+/metrics)", server.log())
        assert metrics, server.log()
        with urllib.request.urlopen(metrics.group(1), timeout=10) as response:
            assert response.status == 200
        os.kill(pid, signal.SIGHUP)
        assert wait_until(lambda: "reload" in server.log(), timeout=30), server.log()
        os.kill(pid, signal.SIGTERM)  # the server, not strace: strace ends with it
        ended = server.proc.wait(60) == 0
        assert ended, server.log()
    finally:
        # strace's child, which the launcher does not know: ended here when the
        # test failed first (a killed strace leaves its tracee running)
        if not ended:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    calls: dict[str, list[str]] = {}
    for line in trace.read_text().splitlines():
        m = re.match(r"\d+\s+(?:<\.\.\. )?([a-z0-9_]+)(?: resumed>|\()(.*)", line)
        if m:
            calls.setdefault(m[1], []).append(m[2])
    assert "io_uring_setup" in calls and "io_uring_enter" in calls  # the engine the profile is for
    refused = refused_by_profile()
    used = {name for name in calls if name in refused and name not in ("clone", "clone3")}
    assert not used, f"the server calls what the profile refuses: {sorted(used)}"
    for args in calls.get("clone", []):
        flags = re.search(r"flags=([A-Z_|0-9x]+)", args)
        assert not flags or "CLONE_NEW" not in flags[1], args


def server_pid(path: str) -> int | None:
    """The pid a server at ``path`` reports, once it answers."""
    from pleclient import PleClient, PleError

    try:
        return int(PleClient.query_stats(path, timeout=1.0)["pid"])
    except (PleError, OSError):
        return None
