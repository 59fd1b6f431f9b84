"""Every setting from the environment too (``PLE_SERVER_<KEY>``, as
llama-server takes every flag): command-line flags over the environment, the
environment over the config file, the file over the defaults; each value's
source named by `config show`, `config check` and a running server's stats;
a bad value names its variable; a reload and `config check
--against-running` read the server's own environment, not the asking shell's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from pleclient import PleClient
from pleclient import protocol as p
from pleserver.config import CONFIG_ENV, ENV_PREFIX, SETTINGS
from tests.harness import wait_until

EX_CONFIG = 78


def pleserver(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pleserver.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def show(*args: str, env: dict[str, str]) -> dict:
    result = pleserver("config", "show", "--json", *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_each_setting_has_one_variable_and_none_is_the_config_files():
    names = {s.env for s in SETTINGS.values()}
    assert len(names) == len(SETTINGS)
    assert all(s.env == ENV_PREFIX + s.name.upper() for s in SETTINGS.values())
    assert CONFIG_ENV not in names
    # The clients' variable is the socket setting's: one path for both ends.
    assert SETTINGS["socket"].env == p.SOCKET_ENV


def test_flags_override_the_environment_which_overrides_the_file(tmp_path, checkpoint):
    config = tmp_path / "config.toml"
    config.write_text(
        f'model = "{checkpoint}"\nmax_clients = 5\nchunk_rows = 100\nidle_timeout_s = 30\n'
    )
    env = {
        CONFIG_ENV: str(config),
        "PLE_SERVER_MAX_CLIENTS": "6",
        "PLE_SERVER_CHUNK_ROWS": "200",
        "PLE_SERVER_CACHE_SIZE": "4G",
        "PLE_SERVER_ALLOW_UIDS": "root,0",
    }
    report = show("--max-clients", "7", env=env)
    values, sources = report["config"], report["sources"]
    assert (values["max_clients"], sources["max_clients"]) == (7, "--max-clients")
    assert (values["chunk_rows"], sources["chunk_rows"]) == (200, "$PLE_SERVER_CHUNK_ROWS")
    assert (values["cache_size"], sources["cache_size"]) == (4 << 30, "$PLE_SERVER_CACHE_SIZE")
    assert (values["allow_uids"], sources["allow_uids"]) == ([0], "$PLE_SERVER_ALLOW_UIDS")
    assert (values["idle_timeout_s"], sources["idle_timeout_s"]) == (30.0, str(config))
    assert (values["frame_timeout_s"], sources["frame_timeout_s"]) == (10.0, "default")
    # The TOML report says the same, and the layers it came from.
    text = pleserver("config", "check", str(config), env=env)
    assert text.returncode == 0, text.stderr
    assert f"(defaults < {config} < environment)" in text.stdout.splitlines()[0]
    assert re.search(r"^chunk_rows = 200 +# \$PLE_SERVER_CHUNK_ROWS$", text.stdout, re.M)


def test_an_empty_variable_counts_as_unset(tmp_path):
    report = show("--model", str(tmp_path), env={"PLE_SERVER_MAX_CLIENTS": ""})
    assert report["sources"]["max_clients"] == "default"


def test_a_bad_value_names_its_variable(tmp_path, checkpoint):
    env = {"PLE_SERVER_CACHE_SIZE": "lots", "PLE_SERVER_IO": "fast"}
    served = pleserver("serve", "--model", str(checkpoint), env=env)
    assert served.returncode == EX_CONFIG, served.stderr
    assert "$PLE_SERVER_CACHE_SIZE: not a size: 'lots'" in served.stderr
    assert "$PLE_SERVER_IO: must be one of auto, direct, buffered, mmap; got 'fast'" in (
        served.stderr
    )
    checked = pleserver("config", "check", "--json", env={**env, "PLE_SERVER_MODEL": "/m"})
    assert checked.returncode == 1
    assert any(x.startswith("$PLE_SERVER_IO:") for x in json.loads(checked.stdout)["problems"])


def test_a_variable_that_is_no_setting_is_a_warning_naming_the_likely_one(tmp_path):
    result = pleserver(
        "config", "show", "--model", str(tmp_path), env={"PLE_SERVER_CACHESIZE": "4G"}
    )
    assert result.returncode == 0, result.stderr
    assert (
        "PLE_SERVER_CACHESIZE is not a setting's variable and is ignored "
        "(did you mean PLE_SERVER_CACHE_SIZE?)" in result.stderr
    )


def test_serve_help_names_each_settings_variable():
    text = " ".join(pleserver("serve", "--help").stdout.split())
    for s in SETTINGS.values():
        assert f"env: {s.env})" in text or f"env: {s.env};" in text, s.name


def test_the_environment_reaches_a_running_server_and_its_stats_name_it(
    start_server, checkpoint, tmp_path
):
    config = tmp_path / "config.toml"
    config.write_text("max_clients = 5\nchunk_rows = 100\n")
    env = {CONFIG_ENV: str(config), "PLE_SERVER_MAX_CLIENTS": "6", "PLE_SERVER_SPIN_US": "1ms"}
    server = start_server(checkpoint, env=env)
    report = PleClient.query_stats(server.socket)["config"]
    assert report["env"] == {"max_clients": "6", "spin_us": "1ms"}
    settings = report["settings"]
    assert (settings["max_clients"], settings["spin_us"], settings["chunk_rows"]) == (6, 1000, 100)
    assert "; environment: PLE_SERVER_MAX_CLIENTS PLE_SERVER_SPIN_US;" in server.log()
    # The same through the command line's report.
    stats = pleserver("stats", "--json", "--socket", server.socket)
    assert json.loads(stats.stdout)["config"]["settings"]["max_clients"] == 6, stats.stderr


def test_a_reload_and_against_running_read_the_servers_environment_not_the_shells(
    start_server, checkpoint, tmp_path
):
    config = tmp_path / "config.toml"
    config.write_text("max_clients = 5\nchunk_rows = 100\n")
    server = start_server(checkpoint, env={CONFIG_ENV: str(config), "PLE_SERVER_MAX_CLIENTS": "6"})
    config.write_text("max_clients = 9\nchunk_rows = 300\n")
    # Asked from a shell without the variable: the server's own still wins.
    check = pleserver("config", "check", "--against-running", "--socket", server.socket, "--json")
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["reload"] == ["chunk_rows"], report
    assert report["against"]["running"]["env"] == {"PLE_SERVER_MAX_CLIENTS": "6"}
    text = pleserver("config", "check", "--against-running", "--socket", server.socket)
    assert "with its environment's PLE_SERVER_MAX_CLIENTS over it" in text.stdout, text.stderr
    os.kill(server.pid, signal.SIGHUP)

    def reloaded() -> dict | None:
        settings = PleClient.query_stats(server.socket)["config"]["settings"]
        return settings if settings["chunk_rows"] == 300 else None

    assert wait_until(reloaded, 30), server.log_tail()
    assert reloaded()["max_clients"] == 6
    assert "the environment's PLE_SERVER_MAX_CLIENTS" in server.log()


def test_the_launcher_passes_on_only_the_settings_it_is_given(
    start_server, checkpoint, monkeypatch
):
    # A shell's exported settings are for its own `pleserver serve`, not for
    # the servers that tests, benchmarks and the demo launch.
    monkeypatch.setenv("PLE_SERVER_CHUNK_ROWS", "123")
    server = start_server(checkpoint)
    assert PleClient.query_stats(server.socket)["config"]["env"] == {}


def test_the_socket_variable_places_the_server_where_stats_finds_it(checkpoint, tmp_path):
    sock = str(tmp_path / "here.sock")
    env = {**os.environ, p.SOCKET_ENV: sock}
    served = subprocess.Popen(
        [sys.executable, "-m", "pleserver.cli", "serve", "--model", str(checkpoint)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stats = None

        def answered() -> bool:
            nonlocal stats
            stats = pleserver("stats", "--json", env={p.SOCKET_ENV: sock})
            return stats.returncode == 0

        assert wait_until(answered, 60), stats.stderr if stats else ""
        report = json.loads(stats.stdout)
        assert report["socket"] == sock and report["config"]["env"] == {"socket": sock}
    finally:
        served.send_signal(signal.SIGTERM)
        _, err = served.communicate(timeout=30)
    assert served.returncode == 0, err
