"""The config file: defaults < file < flags, every error naming its key and
source, `pleserver config check`, and the documented example."""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pleclient import protocol as p
from pleserver.config import (
    GROUPS,
    SETTINGS,
    ConfigError,
    format_duration,
    format_size,
    load_config,
    parse_duration,
    parse_host_port,
    parse_size,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "config.toml"
DGX_SPARK = EXAMPLE.parent / "boxes" / "dgx-spark.toml"
EX_CONFIG = 78


def pleserver(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pleserver.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def write(tmp_path, checkpoint):
    """write(text) → a config file holding `model` (the test checkpoint) and text."""
    count = 0

    def write(text: str, model: bool = True) -> Path:
        nonlocal count
        count += 1
        path = tmp_path / f"config-{count}.toml"
        model = model and not text.startswith("model")
        path.write_text((f'model = "{checkpoint}"\n' if model else "") + text + "\n")
        return path

    return write


# ---------------------------------------------------------------- precedence
def test_file_overrides_defaults_and_flags_override_the_file(write):
    path = write('max_clients = 3\nprewarm_budget = "16G"\nallow_uids = [0]')
    loaded = load_config(str(path), {"max_clients": "5"})
    cfg = loaded.config
    assert cfg.max_clients == 5 and loaded.sources["max_clients"] == "--max-clients"
    assert cfg.prewarm_budget == 16 << 30 and loaded.sources["prewarm_budget"] == str(path)
    assert cfg.gather_workers == 4 and loaded.sources["gather_workers"] == "default"


def test_a_list_given_by_flags_replaces_the_files_list(write):
    path = write("allow_uids = [0, 1]")
    assert load_config(str(path), {"allow_uids": ["2", "3,4"]}).config.allow_uids == [2, 3, 4]


def test_none_on_the_command_line_drops_an_optional_value_the_file_sets(write):
    path = write('prewarm_budget = "16G"\nmetrics_address = "127.0.0.1:9478"')
    cfg = load_config(str(path), {"prewarm_budget": "none", "metrics_address": "none"}).config
    assert cfg.prewarm_budget is None and cfg.metrics_address is None


def test_missing_default_file_means_defaults_and_flags(tmp_path, checkpoint):
    loaded = load_config(
        None, {"model": str(checkpoint)}, default_path=str(tmp_path / "absent.toml")
    )
    assert loaded.file is None and loaded.config.max_clients == 64


def test_default_file_is_read_when_no_file_is_named(write):
    path = write("max_clients = 7")
    loaded = load_config(None, default_path=str(path))
    assert loaded.file == str(path) and loaded.config.max_clients == 7


def test_names_of_users_and_groups_resolve_to_numbers(write):
    me = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    cfg = load_config(str(write(f'allow_uids = ["{me}", 0]\nallow_gids = ["{group}"]'))).config
    assert cfg.allow_uids == [os.getuid()] + ([0] if os.getuid() else [])
    assert cfg.allow_gids == [os.getgid()]


def test_sizes_and_modes_accept_their_written_forms(write):
    cfg = load_config(
        str(
            write(
                'max_channel_bytes = "64M"\nprewarm_reserve = "1.5G"\n'
                "prewarm_budget = 4096\nsocket_mode = 0o660"
            )
        )
    ).config
    assert (cfg.max_channel_bytes, cfg.prewarm_reserve, cfg.prewarm_budget) == (
        64 << 20,
        3 << 29,
        4096,
    )
    assert cfg.socket_mode == 0o660
    assert load_config(str(write('socket_mode = "0640"'))).config.socket_mode == 0o640


DURATIONS = [  # (value as written, the setting's unit, value in that unit)
    (2, "s", 2.0),
    (0.5, "s", 0.5),
    ("2", "s", 2.0),
    ("2s", "s", 2.0),
    ("500ms", "s", 0.5),
    ("50us", "s", 50e-6),
    ("50µs", "s", 50e-6),
    ("10m", "s", 600.0),
    ("1h", "s", 3600.0),
    ("1m30s", "s", 90.0),
    (" 1.5 s ", "s", 1.5),
    ("2000", "us", 2000.0),
    ("2ms", "us", 2000.0),
    ("1.5e3ns", "us", 1.5),
    ("-1s", "s", -1.0),
]


@pytest.mark.parametrize("text,unit,value", DURATIONS, ids=[repr(d[:2]) for d in DURATIONS])
def test_durations_read_as_numbers_in_the_settings_unit_or_with_units(text, unit, value):
    assert parse_duration(text, unit) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "s", "ms5", "5 parsecs", "1s2", "1 s 2", "2ms ms", "inf"])
def test_a_duration_that_is_not_one_is_an_error(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    "seconds,text",
    [(5.0, "5s"), (60.0, "1m"), (600.0, "10m"), (2e-3, "2ms"), (50e-6, "50us"), (0.25, "250ms")],
)
def test_durations_are_shown_in_the_largest_whole_unit_and_read_back(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "size,text", [(1 << 30, "1G"), (4 << 30, "4G"), (64 << 10, "64K"), (100, "100")]
)
def test_sizes_are_shown_in_the_largest_whole_unit_and_read_back(size, text):
    assert format_size(size) == text and parse_size(text) == size


def test_every_duration_setting_takes_units_in_the_file_and_on_the_command_line(write):
    durations = [s for s in SETTINGS.values() if s.kind == "duration"]
    assert {s.name for s in durations} >= {
        "hello_timeout_s",
        "idle_timeout_s",
        "frame_timeout_s",
        "hotset_save_interval",
        "spin_us",
        "gpu_poll_us",
        "watchdog_s",
        "metrics_timeout_s",
    }
    path = write("\n".join(f'{s.name} = "1500ms"' for s in durations))
    from_file = load_config(str(path)).config
    from_flags = load_config(str(write("")), {s.name: "1.5s" for s in durations}).config
    for s in durations:
        expected = 1.5 if s.unit == "s" else 1_500_000
        assert getattr(from_file, s.name) == getattr(from_flags, s.name) == expected, s.name
        # µs settings stay whole numbers: the serving loop takes them as such.
        assert type(getattr(from_file, s.name)) is type(s.default or 0.0), s.name


def test_bare_numbers_keep_their_old_meaning(write):
    cfg = load_config(
        str(write("spin_us = 2000\nhello_timeout_s = 5\nhotset_save_interval = 600"))
    ).config
    assert (cfg.spin_us, cfg.hello_timeout_s, cfg.hotset_save_interval) == (2000, 5.0, 600.0)


def test_every_setting_is_in_a_group_and_a_new_one_inherits_the_group_before_it():
    assert {s.group for s in SETTINGS.values()} <= set(GROUPS)
    names = list(SETTINGS)
    # gather_workers names its group; parallel_min_rows, after it, names none.
    assert SETTINGS["parallel_min_rows"].group == SETTINGS["gather_workers"].group == "serving"
    assert names.index("parallel_min_rows") == names.index("gather_workers") + 1


def test_default_capacity_follows_a_lower_max_capacity(write):
    cfg = load_config(str(write("max_capacity = 100\nmax_depth = 2"))).config
    assert (cfg.default_capacity, cfg.default_depth) == (100, 2)


def test_serve_uses_the_file_and_flags_over_it(start_server, checkpoint, write):
    path = write("max_capacity = 100\ndefault_depth = 2")
    from_file = start_server(checkpoint, "--config", str(path))
    with from_file.client() as client:
        assert (client.capacity, client.depth) == (100, 2)
    from_flags = start_server(checkpoint, "--config", str(path), "--max-capacity", "200")
    with from_flags.client() as client:
        assert (client.capacity, client.depth) == (200, 2)
    defaults = start_server(checkpoint, "--config", str(write("")))
    with defaults.client() as client:
        assert (client.capacity, client.depth) == (p.DEFAULT_CAPACITY, p.DEFAULT_DEPTH)


# -------------------------------------------------------------------- errors
BAD_VALUES = [
    ("max_clients = 0", "max_clients", "at least 1"),
    ('max_clients = "many"', "max_clients", "must be an integer"),
    ("max_clients = true", "max_clients", "must be an integer"),
    ("gather_workers = 1.5", "gather_workers", "must be an integer"),
    ("spin_us = -1", "spin_us", "at least 0"),
    ('prewarm = "fast"', "prewarm", "one of none, full"),
    ('prewarm_budget = "12Q"', "prewarm_budget", "not a size"),
    ("prewarm_budget = [1]", "prewarm_budget", "must be a size"),
    ('prewarm_reserve = "-1G"', "prewarm_reserve", "at least 0"),
    ('allow_uids = ["no-such-user-ple"]', "allow_uids", "no user named 'no-such-user-ple'"),
    ("allow_uids = [-1]", "allow_uids", "not negative"),
    ('allow_gids = ["no-such-group-ple"]', "allow_gids", "no group named 'no-such-group-ple'"),
    ("allow_gids = [1.5]", "allow_gids", "names or numbers"),
    ('socket_mode = "0668"', "socket_mode", "permission mode"),
    ("socket_mode = 0o1777", "socket_mode", "permission mode"),
    (f'socket = "/run/{"s" * 110}.sock"', "socket", "at most 107"),
    ('socket = ""', "socket", "non-empty path"),
    ("model = 3", "model", "non-empty path"),
    ('metrics_address = "localhost"', "metrics_address", "host:port"),
    ('metrics_address = "127.0.0.1:99999"', "metrics_address", "host:port"),
    ('metrics_address = "::1:9478"', "metrics_address", "goes in brackets: [::1]:9478"),
    ('log_level = "LOUD"', "log_level", "one of DEBUG"),
    ("watchdog_s = 0", "watchdog_s", "at least 10ms, got 0"),
    ('watchdog_s = "nan"', "watchdog_s", "finite"),
    ('hello_timeout_s = "1ms"', "hello_timeout_s", "at least 10ms, got '1ms'"),
    ('hello_timeout_s = "5 parsecs"', "hello_timeout_s", "not a duration"),
    ('spin_us = "2ms3"', "spin_us", "a bare number is in us"),
    ('spin_us = "-1ms"', "spin_us", "at least 0s"),
    ("spin_us = true", "spin_us", "must be a duration"),
    ("idle_timeout_s = [1]", "idle_timeout_s", "must be a duration"),
    ("max_depth = 65", "max_depth", f"at most {p.MAX_DEPTH}"),
    ("max_depth = 4\ndefault_depth = 8", "default_depth", "exceeds max_depth (4"),
    ("max_capacity = 10\ndefault_capacity = 20", "default_capacity", "exceeds max_capacity"),
]


@pytest.mark.parametrize("text,key,problem", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_bad_value_is_an_error_naming_the_file_and_key(write, text, key, problem):
    path = write(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert any(
        line.startswith(f"{path}: {key}: ") and problem in line for line in err.value.problems
    ), err.value.problems


ADDRESSES = [
    ("127.0.0.1:9478", ("127.0.0.1", 9478)),
    ("[::1]:9400", ("::1", 9400)),
    ("localhost:0", ("localhost", 0)),
    (" ple.example.com:65535 ", ("ple.example.com", 65535)),
]


@pytest.mark.parametrize("text,parsed", ADDRESSES, ids=[a[0] for a in ADDRESSES])
def test_host_port_addresses_parse_to_host_and_port(text, parsed):
    assert parse_host_port(text) == parsed


BAD_ADDRESSES = [
    ("localhost", "no port"),
    ("[::1]", "no port"),
    ("host:", "no port"),
    (":9400", "no host"),
    ("::1:9400", "goes in brackets: [::1]:9400"),
    ("[::1:9400", "unbalanced brackets"),
    ("host:65536", "port '65536'"),
    ("host:-1", "port '-1'"),
    ("host:http", "port 'http'"),
]


@pytest.mark.parametrize("text,why", BAD_ADDRESSES, ids=[a[0] for a in BAD_ADDRESSES])
def test_a_bad_host_port_address_is_an_error_saying_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_host_port(text)


def test_an_unknown_key_is_an_error_suggesting_the_known_one(write):
    path = write("max_clinets = 3")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert err.value.problems == [
        f"{path}: unknown key 'max_clinets' (did you mean 'max_clients'?)"
    ]


def test_a_table_section_is_an_error_saying_keys_are_top_level(write):
    path = write("[server]\nmax_clients = 3")
    with pytest.raises(ConfigError, match=r"unknown key 'server' \(settings are top-level"):
        load_config(str(path))


def test_every_problem_is_reported_at_once(write):
    path = write('max_clients = 0\nprewarm = "fast"\nbogus = 1')
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert len(err.value.problems) == 3


def test_a_bad_flag_value_is_an_error_naming_the_flag(write):
    with pytest.raises(ConfigError) as err:
        load_config(str(write("")), {"max_clients": "abc", "allow_gids": ["no-such-group-ple"]})
    assert sorted(err.value.problems) == [
        "--allow-gid: no group named 'no-such-group-ple' on this host; create it or give its "
        "number",
        "--max-clients: must be an integer, got 'abc'",
    ]


def test_model_is_required(write):
    with pytest.raises(ConfigError, match="model: required"):
        load_config(str(write("max_clients = 3", model=False)))


def test_invalid_toml_is_an_error_naming_the_file_and_line(write):
    path = write("max_clients = = 3")
    with pytest.raises(ConfigError, match=re.escape(str(path)) + r": not valid TOML: .*line 2"):
        load_config(str(path))


def test_a_missing_named_file_is_an_error(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=re.escape(f"{path}: no such config file")):
        load_config(str(path))


def test_serve_with_an_invalid_config_exits_with_ex_config_naming_the_key(write, tmp_path):
    path = write("max_clients = -2")
    result = pleserver("serve", "--config", str(path), "--socket", str(tmp_path / "s.sock"))
    assert result.returncode == EX_CONFIG
    assert f"{path}: max_clients: must be at least 1, got -2" in result.stderr
    assert not (tmp_path / "s.sock").exists()


def test_serve_with_a_missing_config_file_exits_with_ex_config(tmp_path):
    result = pleserver("serve", "--config", str(tmp_path / "absent.toml"))
    assert result.returncode == EX_CONFIG
    assert f"{tmp_path / 'absent.toml'}: no such config file" in result.stderr


def test_the_environment_names_the_file_when_no_flag_does(write, tmp_path):
    path = write("max_clients = -3")
    result = pleserver("serve", env={"PLE_SERVER_CONFIG": str(path)})
    assert result.returncode == EX_CONFIG
    assert f"{path}: max_clients: must be at least 1" in result.stderr
    missing = pleserver("serve", env={"PLE_SERVER_CONFIG": str(tmp_path / "absent.toml")})
    assert missing.returncode == EX_CONFIG and "no such config file" in missing.stderr


# ------------------------------------------------------------- config check
def test_config_check_prints_the_effective_config_with_sources(write):
    path = write('max_clients = 3\nprewarm_budget = "1G"\nallow_uids = ["root"]')
    result = pleserver("config", "check", str(path))
    assert result.returncode == 0, result.stderr
    lines = {
        line.split(" = ")[0]: line
        for line in result.stdout.splitlines()
        if " = " in line and not line.startswith("#")
    }
    assert set(lines) | {
        "max_channel_memory",
        "prewarm_budget",
        "cache_size",
        "read_buffer_memory",
        "watchdog_s",
        "metrics_address",
        "health_socket",
        "lookup_trace",
    } >= set(SETTINGS)
    assert re.fullmatch(rf"max_clients = 3 +# {re.escape(str(path))}", lines["max_clients"])
    assert re.fullmatch(r"prewarm_budget = 1073741824 +# .*", lines["prewarm_budget"])
    assert re.fullmatch(r"allow_uids = \[0\] +# .*", lines["allow_uids"])
    assert re.fullmatch(r"gather_workers = 4 +# default", lines["gather_workers"])


def test_config_check_output_is_itself_a_valid_config(write, tmp_path):
    path = write('max_clients = 3\nsocket_mode = 0o660\nmetrics_address = "127.0.0.1:0"')
    again = tmp_path / "again.toml"
    again.write_text(pleserver("config", "check", str(path)).stdout)
    first = json.loads(pleserver("config", "check", str(path), "--json").stdout)["config"]
    second = json.loads(pleserver("config", "check", str(again), "--json").stdout)["config"]
    assert first == second


def test_config_check_json_lists_every_problem(write):
    path = write("max_clients = 0\nbogus = 1")
    result = pleserver("config", "check", str(path), "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["file"] == str(path)
    assert len(report["problems"]) == 2


def test_config_check_of_a_bad_file_exits_1_with_the_problems_on_stderr(write):
    path = write("max_clients = 0")
    result = pleserver("config", "check", str(path))
    assert result.returncode == 1 and result.stdout == ""
    assert f"{path}: max_clients: must be at least 1, got 0" in result.stderr


def test_config_check_refuses_a_model_it_cannot_read(write, tmp_path):
    path = write(f'model = "{tmp_path / "absent"}"')
    result = pleserver("config", "check", str(path))
    assert result.returncode == 1
    assert f"error: model: {tmp_path / 'absent'}: not a directory" in result.stderr


@pytest.mark.parametrize(
    "settings, warned",
    [
        ('io = "direct"\nprewarm = "full"', "prewarm = full has no effect: io = direct"),
        # the test tables (6 MiB) do not fit a 1 MiB cache: auto reads them direct
        (
            'prewarm = "full"\ncache_size = "1M"',
            "prewarm = full has no effect: io = auto chooses direct on this host (auto: the "
            "tables (6.11 MiB) exceed the 1.00 MiB budget",
        ),
        ('io = "mmap"\ncache_size = "1G"', "cache_size has no effect: io = mmap"),
        ('prewarm = "full"', None),  # auto maps these small tables: prewarm applies
    ],
)
def test_config_check_warns_of_settings_that_would_have_no_effect(write, settings, warned):
    path = write(settings)
    result = pleserver("config", "check", str(path))
    assert result.returncode == 0, result.stderr
    report = json.loads(pleserver("config", "check", str(path), "--json").stdout)
    if warned is None:
        assert "warning" not in result.stderr and report["warnings"] == [], result.stderr
    else:
        assert f"warning: {warned}" in result.stderr, result.stderr
        assert len(report["warnings"]) == 1 and warned in report["warnings"][0]


# ------------------------------------------------------------------ example
def test_the_example_config_is_valid(tmp_path, checkpoint):
    # Valid as it is but for its model, which this host does not have.
    result = pleserver("config", "check", str(EXAMPLE), "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["problems"] == [
        "model: /models/Qwen3.8-Flash-Next: not a directory; pass the model's local snapshot "
        "directory (the one with config.json and *.safetensors)"
    ], report
    here = tmp_path / "config.toml"
    here.write_text(
        EXAMPLE.read_text().replace('"/models/Qwen3.8-Flash-Next"', f'"{checkpoint}"', 1)
    )
    result = pleserver("config", "check", str(here), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ok"] is True


def test_the_dgx_spark_config_is_valid_and_warns_of_nothing(tmp_path, checkpoint):
    # deploy/boxes/dgx-spark.toml: valid as it is but for its model, as config.toml.
    result = pleserver("config", "check", str(DGX_SPARK), "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["problems"] == [
        "model: /models/Qwen3.8-Flash-Next: not a directory; pass the model's local snapshot "
        "directory (the one with config.json and *.safetensors)"
    ], report
    here = tmp_path / "dgx-spark.toml"
    here.write_text(
        DGX_SPARK.read_text().replace('"/models/Qwen3.8-Flash-Next"', f'"{checkpoint}"', 1)
    )
    result = pleserver("config", "check", str(here), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["warnings"] == []
    config, sources = report["config"], report["sources"]
    assert config["gpu_memory"] == "unified" and config["io"] == "direct"
    assert config["cache_size"] == 3 << 30 and sources["cache_size"] == str(here)


def test_the_example_config_documents_every_key():
    text = EXAMPLE.read_text()
    documented = set(re.findall(r"^(?:# )?([a-z_]+) = ", text, re.MULTILINE))
    assert documented == set(SETTINGS)


def test_every_setting_is_a_serve_flag():
    result = pleserver("serve", "--help")
    for setting in SETTINGS.values():
        assert re.search(rf"^  {setting.flag}[ ,]", result.stdout, re.MULTILINE), setting.flag


def example_sections() -> list[tuple[str, set[str]]]:
    """deploy/config.toml's ``# --- Title ---`` sections and the keys in each."""
    sections: list[tuple[str, set[str]]] = []
    for line in EXAMPLE.read_text().splitlines():
        heading = re.fullmatch(r"# --- (.*?) -+", line)
        if heading:
            sections.append((heading.group(1), set()))
            continue
        key = re.match(r"^(?:# )?([a-z_]+) = ", line)
        if key and sections:
            sections[-1][1].add(key.group(1))
    return sections


def test_the_example_configs_sections_are_the_groups_of_serve_help():
    sections = example_sections()
    groups = [
        (title, {s.name for s in SETTINGS.values() if s.group == key})
        for key, (title, _) in GROUPS.items()
    ]
    assert len(sections) == len(groups), [title for title, _ in sections]
    for (title, keys), (section, documented) in zip(groups, sections, strict=True):
        assert section.lower().startswith(title.lower()), (section, title)
        assert documented == keys, (
            f"deploy/config.toml's section {section!r} documents {sorted(documented)}; the "
            f"settings of group {title!r} are {sorted(keys)} (a setting's `group`, in "
            "pleserver/config.py, places it in both)"
        )
