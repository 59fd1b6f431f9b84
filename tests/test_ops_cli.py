"""The command line an operator meets first: `serve --help` in groups with
every default and choice, switches both ways (and the old spelling, noted as
deprecated), durations with units, help on every option, a quiet Ctrl-C,
shell completion (argcomplete's scripts in real bash, zsh and fish), the
man page (current with the parser), the packaged deploy files and
`pleserver config default|show`."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from pleserver.cli import EX_CONFIG, build_parser
from pleserver.config import GROUPS, SETTINGS
from pleserver.ops import deployfiles
from tests.harness import RawSession, wait_until

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"


def pleserver(*args: str, timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pleserver.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def require_tool(name: str) -> str:
    """The tool's path; missing, the test fails in CI (.ci/run installs it)
    and is skipped elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: `apt-get install {name}` (.ci/run installs it in CI)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


# ------------------------------------------------------------------ --help
def help_sections(text: str) -> dict[str, str]:
    """``serve --help`` cut at its section titles ("io and cache:")."""
    sections: dict[str, str] = {}
    title = ""
    for line in text.splitlines():
        if re.fullmatch(r"[a-z][a-z ,]*:", line):
            title = line[:-1]
            sections[title] = ""
        elif title:
            sections[title] += line + "\n"
    return sections


def option_help(section: str, flag: str) -> str:
    """The help of ``flag`` in a help section: its lines, joined."""
    match = re.search(rf"^  {re.escape(flag)}\b.*?(?=^  -|\Z)", section, re.MULTILINE | re.DOTALL)
    assert match, f"{flag} not in:\n{section}"
    return " ".join(match.group(0).split())


def test_serve_help_lists_every_setting_in_its_group_with_its_default():
    result = pleserver("serve", "--help")
    assert result.returncode == 0, result.stderr
    sections = help_sections(result.stdout)
    titles = [title for title, _ in GROUPS.values()]
    assert [t for t in sections if t in titles] == titles, list(sections)
    for s in SETTINGS.values():
        text = option_help(sections[GROUPS[s.group][0]], s.flag)
        if s.name == "model":  # required: no default
            assert "(required)" in text, text
            continue
        assert f"default: {s.format(s.default)}" in text, text
    # As a person writes them: sizes and durations in units, modes in octal.
    io = sections["io and cache"]
    assert "--io {auto,direct,buffered,mmap}" in io
    assert "--read-engine {auto,io_uring,threads}" in io
    loop = sections["serving loop"]
    assert "default: 2ms; a bare number is in µs" in option_help(loop, "--spin-us")
    assert "default: 50us" in option_help(loop, "--gpu-poll-us")
    assert "default: 5s; a bare number is in s" in option_help(
        sections["sessions"], "--hello-timeout-s"
    )
    assert "default: 10m" in option_help(sections["hot set and prewarm"], "--hotset-save-interval")
    assert "default: 1G" in option_help(sections["channels and limits"], "--max-channel-bytes")
    assert "default: 0o666" in option_help(sections["model and socket"], "--socket-mode")
    assert "--cache-mlock, --no-cache-mlock" in io and (
        "(default: false; env: PLE_SERVER_CACHE_MLOCK)" in option_help(io, "--cache-mlock")
    )
    assert "--[no-]SWITCH" in result.stdout.splitlines()[0]


def walk(parser: argparse.ArgumentParser, path: str = "pleserver"):
    """(command, its parser, the help its parent gives it) for every command."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{path} {name}")


def test_every_option_of_every_command_has_help():
    commands = dict(walk(build_parser()))
    assert {
        "pleserver serve",
        "pleserver stats",
        "pleserver inspect",
        "pleserver demo",
        "pleserver doctor",
        "pleserver plan",
        "pleserver config check",
        "pleserver config show",
        "pleserver config default",
        "pleserver files",
        "pleserver completion",
    } <= set(commands)
    for path, parser in commands.items():
        assert parser.description, path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                assert all(a.help for a in action._choices_actions), path
            else:
                assert action.help and len(action.help) > 8, (path, action.dest)


def test_options_with_a_value_show_their_default():
    result = pleserver("demo", "--help")
    assert "(default: 3s)" in result.stdout and "(default: 2)" in result.stdout
    assert "(default: WARNING)" in result.stdout
    assert "{DEBUG,INFO,WARNING,ERROR,CRITICAL}" in result.stdout
    assert "(default: 2s)" in pleserver("doctor", "--help").stdout


# ---------------------------------------------------------- switches, durations
def show(*args: str, env: dict | None = None) -> dict:
    """`pleserver config show --json` of a model and these flags: the config
    `serve` would run with."""
    result = pleserver(
        "config",
        "show",
        "--json",
        "--model",
        "/models/m",
        *args,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_switches_go_both_ways(tmp_path):
    defaults = show()["config"]
    assert defaults["cache_hugepages"] is True and defaults["cache_mlock"] is False
    flipped = show("--no-cache-hugepages", "--cache-mlock")
    assert flipped["config"]["cache_hugepages"] is False
    assert flipped["config"]["cache_mlock"] is True
    assert flipped["sources"]["cache_mlock"] == "--cache-mlock"
    # Over the file: the flag wins, either way.
    config = tmp_path / "config.toml"
    config.write_text("cache_mlock = true\ncache_hugepages = false\n")
    over = show("--config", str(config), "--no-cache-mlock", "--cache-hugepages")["config"]
    assert over["cache_mlock"] is False and over["cache_hugepages"] is True


def test_the_old_switch_spelling_still_works_with_a_deprecation_note():
    result = pleserver(
        "config", "show", "--json", "--model", "/m", "--cache-mlock", "yes", "--cache-hugepages=off"
    )
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)["config"]
    assert config["cache_mlock"] is True and config["cache_hugepages"] is False
    assert "--cache-mlock yes: a value after a switch is deprecated; write --cache-mlock" in (
        result.stderr
    )
    assert "--cache-hugepages off: a value after a switch is deprecated; write " in result.stderr
    assert "--no-cache-hugepages" in result.stderr
    bad = pleserver("config", "show", "--model", "/m", "--cache-mlock", "maybe")
    assert bad.returncode == 1 and "--cache-mlock: must be true or false" in bad.stderr
    no_value = pleserver("config", "show", "--model", "/m", "--no-cache-mlock=1")
    assert no_value.returncode == 2 and "--no-cache-mlock takes no value" in no_value.stderr


def test_a_server_started_with_the_old_spelling_serves_and_logs_the_deprecation(
    start_server, checkpoint
):
    server = start_server(checkpoint, "--io", "direct", "--cache-hugepages", "false")
    with server.client() as client:
        assert client.lookup(1, [0, 1]).shape == (2, 160)
        cache = client.stats()["dataplane"]["cache"]
    assert cache["hugepages"] is False
    assert (
        "--cache-hugepages false: a value after a switch is deprecated; "
        "write --no-cache-hugepages" in server.log()
    )


def test_durations_with_units_reach_the_server(start_server, checkpoint):
    server = start_server(checkpoint, "--hello-timeout-s", "300ms", "--spin-us", "1ms")
    with RawSession(server.socket) as silent:  # connects, never says hello
        assert silent.closed_by_server(timeout=10)
    assert "no 'hello' within 0.3 s of connecting" in server.log()
    config = show("--hello-timeout-s", "300ms", "--spin-us", "1ms", "--idle-timeout-s", "2m")
    assert config["config"]["hello_timeout_s"] == 0.3
    assert config["config"]["spin_us"] == 1000 and config["config"]["idle_timeout_s"] == 120


def test_a_command_line_error_in_serve_is_a_configuration_error(tmp_path):
    for args in (["--no-such-flag"], ["--max-clients"], ["--no-cache-mlock=yes"]):
        result = pleserver("serve", "--socket", str(tmp_path / "s.sock"), *args)
        assert result.returncode == EX_CONFIG, (args, result.stderr)
        assert "pleserver serve: error:" in result.stderr and "Traceback" not in result.stderr
    bad_value = pleserver("serve", "--model", "/m", "--spin-us", "fast")
    assert bad_value.returncode == EX_CONFIG
    assert "--spin-us: not a duration: 'fast'" in bad_value.stderr
    # Elsewhere a usage error is argparse's 2.
    assert pleserver("stats", "--no-such-flag").returncode == 2
    assert pleserver("stats", "--watch", "soon").returncode == 2


# ------------------------------------------------------------------- Ctrl-C
def sigint_as_a_terminal_has_it() -> None:
    """In the child before exec: SIGINT at its default. A command started in
    the background by a shell without job control (``cmd &`` in a script, as
    CI runners may start the tests) inherits SIGINT ignored, and Python then
    installs no KeyboardInterrupt handler: Ctrl-C would not reach it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c(proc: subprocess.Popen) -> tuple[str, str]:
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group. Returns
    what the command printed; checks that its group is gone soon after."""
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    # Every process it started has ended (multiprocessing's resource tracker
    # takes a moment after its parent).
    assert wait_until(
        lambda: subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1,
        timeout=15,
    ), subprocess.run(["ps", "-g", str(proc.pid), "-f"], capture_output=True, text=True).stdout
    return out, err


def test_ctrl_c_ends_stats_watch_quietly_with_130(server):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pleserver.cli",
            "stats",
            "--socket",
            server.socket,
            "--watch",
            "200ms",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell's job
        preexec_fn=sigint_as_a_terminal_has_it,
    )
    try:
        first = proc.stdout.readline()  # it is watching
        assert first.startswith("ple-server pid "), first
        time.sleep(0.5)  # into its sleep, or another query
        out, err = ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err == "", err  # no traceback, no KeyboardInterrupt
    assert "ple-server pid" in out
    assert server.running  # the server is not the one interrupted


def test_ctrl_c_ends_the_demo_quietly_with_130_and_leaves_nothing_running(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pleserver.cli",
            "demo",
            "--seconds",
            "120",
            "--clients",
            "2",
            "--cache-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=sigint_as_a_terminal_has_it,
    )

    def processes() -> list[str]:
        out = subprocess.run(
            ["ps", "-ww", "-g", str(proc.pid), "-o", "args="], capture_output=True, text=True
        ).stdout
        return out.splitlines()

    try:
        # Interrupted while its server and both clients run.
        assert wait_until(
            lambda: (
                sum("spawn_main" in p for p in processes()) >= 2
                and any("pleserver.cli serve" in p for p in processes())
            ),
            timeout=120,
            interval=0.2,
        ), processes()
        time.sleep(1.0)  # the clients are looking rows up
        out, err = ctrl_c(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert out == "", out


# --------------------------------------------------------------- completion
# argcomplete's scripts run `pleserver` itself to complete: on the PATH here
# as a wrapper running this checkout's CLI with this interpreter.
def completion_setup(shell: str, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The script `pleserver completion SHELL` prints, saved (as zsh's $fpath
    wants it, ``_pleserver``), and the environment its shell runs in."""
    result = pleserver("completion", shell)
    assert result.returncode == 0, result.stderr
    name = {"bash": "pleserver.bash", "zsh": "_pleserver", "fish": "pleserver.fish"}[shell]
    script = tmp_path / name
    script.write_text(result.stdout)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "pleserver"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m pleserver.cli "$@"\n')
    wrapper.chmod(0o755)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": path}
    return script, env


# (command line up to the cursor, the word at the cursor, what completes it)
COMPLETIONS = [
    (
        "pleserver",
        "",
        {
            "serve",
            "config",
            "inspect",
            "doctor",
            "plan",
            "stats",
            "health",
            "demo",
            "files",
            "completion",
        },
    ),
    ("pleserver", "se", {"serve"}),
    ("pleserver serve", "--i", {"--io", "--idle-wait", "--idle-timeout-s"}),
    ("pleserver serve --io", "", {"auto", "direct", "buffered", "mmap"}),
    ("pleserver serve --max-clients 4 --prewarm", "f", {"full"}),
    ("pleserver serve --cache-mlock --read-engine", "", {"auto", "io_uring", "threads"}),
    ("pleserver serve", "--no-cache-m", {"--no-cache-mlock"}),
    ("pleserver serve --allow-uid", "roo", {"root"}),
    ("pleserver config", "", {"check", "show", "default"}),
    ("pleserver config check", "--j", {"--json"}),
    ("pleserver stats", "--w", {"--watch"}),
    ("pleserver completion", "", {"bash", "zsh", "fish"}),
    ("pleserver demo --log-level", "W", {"WARNING"}),
    ("pleserver serve --log-format", "", {"text", "json"}),
]


def path_completions(tmp_path: Path) -> list[tuple[str, str, set[str]]]:
    """Directories where a directory is asked for, files too where a file is."""
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    (tmp_path / "mod.toml").touch()
    return [
        ("pleserver serve --model", f"{tmp_path}/mo", {f"{tmp_path}/models/"}),
        ("pleserver inspect", f"{tmp_path}/mo", {f"{tmp_path}/models/"}),
        (
            "pleserver serve --config",
            f"{tmp_path}/mo",
            {f"{tmp_path}/models/", f"{tmp_path}/mod.toml"},
        ),
    ]


def test_bash_completion_completes_commands_options_and_values(tmp_path):
    bash = require_tool("bash")
    script, env = completion_setup("bash", tmp_path)
    cases = [*COMPLETIONS, *path_completions(tmp_path)]
    lines = [f"source {script}"]
    for before, cur, _ in cases:
        words = " ".join(f"'{w}'" for w in [*before.split(), cur])
        line = f"{before} {cur}"
        # What bash sets before it calls a completion function.
        lines.append(
            f"COMP_LINE='{line}'; COMP_POINT={len(line)}; COMP_WORDS=({words}); "
            "COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMPREPLY=(); "
            f"_python_argcomplete pleserver '{cur}' '{before.split()[-1]}'; "
            'printf "%s\\n" "${COMPREPLY[*]}"'
        )
    lines.append("complete -p pleserver")
    result = subprocess.run(
        [bash, "--norc", "-c", "\n".join(lines)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    *replies, registered = result.stdout.splitlines()
    assert registered.endswith("-F _python_argcomplete pleserver"), registered
    for (before, cur, expected), reply in zip(cases, replies, strict=True):
        assert set(reply.split()) == expected, (before, cur, reply)


# zsh completes only inside its line editor: a zsh in a pseudo-terminal
# (zsh/zpty) loads the script from $fpath with compinit, gets the line and a
# TAB, and compadd, wrapped, prints each candidate as <<candidate>>.
ZSH_CAPTURE = r"""
zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z "PS1=''; RPS1=''; fpath=($1 \$fpath); autoload -Uz compinit; compinit -u -D"
wrap='compadd() { local -a m; builtin compadd -O m "$@"'
wrap+='; (( $#m )) && print -rl -- "<""<${^m}>"">"; builtin compadd "$@"; }'
zpty -w z "$wrap"
zpty -w z 'zstyle ":completion:*" menu no; bindkey "^I" complete-word; print "SETUP""-DONE"'
local line all chunk
while zpty -r z line; do [[ $line == *SETUP-DONE* ]] && break; done
zpty -w z "$2"$'\t'
while zpty -r -t z chunk 2>/dev/null || { sleep 0.5; zpty -r -t z chunk 2>/dev/null }; do
  all+=$chunk
done
print -r -- "$all" | grep -ao '<<[^>]*>>' | tr -d '<>' | sort -u
zpty -d z
"""


def test_zsh_completion_completes_commands_options_and_values(tmp_path):
    zsh = require_tool("zsh")
    script, env = completion_setup("zsh", tmp_path)
    check = subprocess.run([zsh, "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    capture = tmp_path / "capture.zsh"
    capture.write_text(textwrap.dedent(ZSH_CAPTURE))
    for before, cur, expected in COMPLETIONS[:1] + COMPLETIONS[2:8] + COMPLETIONS[11:12]:
        result = subprocess.run(
            [zsh, "-f", str(capture), str(tmp_path), f"{before} {cur}"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert set(result.stdout.split()) == expected, (before, cur, result.stdout, result.stderr)
    # Sourced instead of autoloaded, it registers itself.
    sourced = subprocess.run(
        [
            zsh,
            "-f",
            "-c",
            f"autoload -Uz compinit; compinit -u -D; source {script}; print $_comps[pleserver]",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert sourced.stdout.strip() == "_python_argcomplete", sourced.stderr


def test_fish_completion_completes_commands_options_and_values(tmp_path):
    fish = require_tool("fish")
    script, env = completion_setup("fish", tmp_path)
    cases = [*COMPLETIONS, *path_completions(tmp_path)]
    # `complete -C LINE` prints what fish offers at the end of LINE, one a
    # line, each with its description after a tab.
    lines = [f"source {script}"]
    for before, cur, _ in cases:
        lines += [f"complete -C '{before} {cur}'", "echo '=='"]
    result = subprocess.run(
        [fish, "--no-config", "-c", "\n".join(lines)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    replies = result.stdout.split("==\n")[: len(cases)]
    for (before, cur, expected), reply in zip(cases, replies, strict=True):
        offered = {line.split("\t")[0] for line in reply.splitlines()}
        assert offered == expected, (before, cur, reply)


# ---------------------------------------------------------------- man page
def test_the_man_page_is_current_with_the_parser():
    result = subprocess.run(
        [sys.executable, str(REPO / "man" / "make.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    page = (REPO / "man" / "pleserver.1").read_text()
    for s in SETTINGS.values():
        assert roff_escaped(s.flag) in page and roff_escaped(s.env) in page, s.name
    for section in ("ENVIRONMENT", "FILES", "EXIT STATUS", "SEE ALSO"):
        assert f".SH {section}" in page, section
    # A switch is "--name, --no-name", with no value after either.
    switch = roff_escaped("--cache-hugepages")
    assert f"\\fB{switch}\\fR, \\fB{roff_escaped('--no-cache-hugepages')}\\fR\n" in page
    assert "[]" not in page


def roff_escaped(text: str) -> str:
    return text.replace("-", "\\-")


def test_the_man_page_renders_without_roff_warnings():
    groff = require_tool("groff")
    result = subprocess.run(
        # -k: its UTF-8 (µ, ×, ≈) through preconv, as man(1) reads it
        [groff, "-k", "-man", "-Tutf8", "-ww", "-z", str(REPO / "man" / "pleserver.1")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stderr, result.stderr


# ------------------------------------------------------ packaged deploy files
def test_the_package_ships_every_unit_snippet_and_the_config_of_deploy():
    # setup.py copies deploy/config.toml, deploy/boxes/* and deploy/systemd/*:
    # FILES must be them.
    shipped = {
        "config.toml",
        *(f"boxes/{p.name}" for p in (DEPLOY / "boxes").iterdir()),
        *(f"systemd/{p.name}" for p in (DEPLOY / "systemd").iterdir()),
    }
    assert {f.path for f in deployfiles.FILES} == shipped
    folder = deployfiles.directory()
    for f in deployfiles.FILES:
        assert (folder / f.path).read_bytes() == (DEPLOY / f.path).read_bytes(), f.path


def test_files_lists_them_with_where_they_go():
    listing = json.loads(pleserver("files", "--json").stdout)
    folder = Path(listing["dir"])
    assert pleserver("files", "--dir").stdout == f"{folder}\n"
    assert {Path(f["path"]).relative_to(folder).as_posix() for f in listing["files"]} == {
        f.path for f in deployfiles.FILES
    }
    targets = {Path(f["path"]).name: f["installs_to"] for f in listing["files"]}
    assert targets["ple-server.service"] == "/etc/systemd/system/ple-server.service"
    assert targets["ple-server.sysusers"] == "/etc/sysusers.d/ple-server.conf"
    assert targets["config.toml"] == "/etc/ple-server/config.toml"
    text = pleserver("files").stdout
    assert "systemd/ple-server.tmpfiles" in text and "/etc/tmpfiles.d/ple-server.conf" in text


def test_config_default_prints_deploy_config_toml():
    result = pleserver("config", "default")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (DEPLOY / "config.toml").read_text()


def test_config_show_is_the_configuration_serve_would_run_with(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('model = "/models/m"\nmax_clients = 3\nspin_us = "1ms"\n')
    report = show("--max-clients", "5", env={"PLE_SERVER_CONFIG": str(config)})
    assert report["file"] == str(config)
    assert (
        report["config"]["max_clients"] == 5 and report["sources"]["max_clients"] == "--max-clients"
    )
    assert report["config"]["spin_us"] == 1000 and report["sources"]["spin_us"] == str(config)
    text = pleserver("config", "show", "--config", str(config), "--socket", "/run/x.sock")
    assert text.returncode == 0, text.stderr
    assert re.search(r"^socket = \"/run/x.sock\" +# --socket$", text.stdout, re.MULTILINE)
    bad = pleserver("config", "show", "--config", str(config), "--max-clients", "0")
    assert bad.returncode == 1 and "--max-clients: must be at least 1" in bad.stderr


def json_lines(proc: subprocess.Popen):
    """The reports a ``stats --watch --json`` prints, one a line."""
    while line := proc.stdout.readline():
        yield json.loads(line)


def test_stats_watch_gives_each_intervals_rates_and_waits_through_a_restart(
    start_server, checkpoint, tmp_path
):
    sock = str(tmp_path / "ple.sock")
    server = start_server(checkpoint, socket_path=sock)
    args = ["stats", "--socket", sock, "--watch", "100ms", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pleserver", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        reports = json_lines(proc)
        first = next(reports)
        assert first["interval"] is None and first["clients"] == 0  # not itself
        with server.client() as client:
            for seen, report in enumerate(reports):
                client.lookup(1, np.arange(64))
                figures = report["interval"]
                if figures and figures["requests_per_s"] > 0:
                    break
                assert seen < 100, report
            assert report["clients"] == 1 and figures["rows_per_s"] >= figures["requests_per_s"]
            assert figures["p99_s"] > 0 and 0.09 < figures["seconds"] < 5
        old_pid = server.pid
        assert server.stop() == 0
        waiting = next(r for r in reports if "error" in r)  # still watching
        assert waiting["socket"] == sock and "not found" in waiting["error"]
        again = start_server(checkpoint, socket_path=sock)
        back = next(r for r in reports if "pid" in r)
        assert back["pid"] == again.pid != old_pid and back["interval"] is None
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_stats_shows_every_server_of_a_socket_directory(start_server, checkpoint, tmp_path):
    for name in ("a", "b"):
        start_server(checkpoint, socket_path=str(tmp_path / f"{name}.sock"))
    (tmp_path / "not-a-socket").write_text("")
    reports = json.loads(pleserver("stats", "--socket", str(tmp_path), "--json").stdout)
    assert [r["socket"] for r in reports] == [str(tmp_path / "a.sock"), str(tmp_path / "b.sock")]
    text = pleserver("stats", "--socket", str(tmp_path)).stdout
    assert (
        f"== {tmp_path / 'a.sock'}\nple-server pid" in text and f"== {tmp_path / 'b.sock'}" in text
    )


def test_stats_watch_redraws_in_place_on_a_terminal(server):
    import pty

    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pleserver", "stats", "--socket", server.socket, "--watch", "100ms"],
        stdout=child,
        stderr=subprocess.PIPE,
    )
    os.close(child)
    try:
        seen = b""
        deadline = time.monotonic() + 30
        # Three clears: the second draw (between the 2nd and the 3rd) is whole.
        while seen.count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < deadline:
            seen += os.read(main, 65536)
        draws = seen.split(b"\x1b[H\x1b[2J")
        assert len(draws) >= 4 and draws[2].startswith(b"ple-server pid "), seen[-2000:]
        assert b"last 0." in draws[2] or b"last 1." in draws[2], draws[2]  # the interval's rates
    finally:
        proc.kill()
        proc.wait()
        os.close(main)
