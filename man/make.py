"""pleserver(1), the man page, generated from the command line's own parser
(``pleserver.cli.build_parser``) with argparse-manpage: every command, option,
default and choice as ``--help`` shows them, plus the sections a parser does
not hold (environment, files, exit status, see also).

    python man/make.py           write man/pleserver.1 (``make man``)
    python man/make.py --check   exit 1 when man/pleserver.1 is not current

The page is committed, so that building the package needs neither
argparse-manpage nor an import of the package: setup.py installs it as
``share/man/man1/pleserver.1``, and tests/test_ops_cli.py runs ``--check``.
Its date is the day its text last changed: kept when the text is the same,
so that making it again changes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

from argparse_manpage.manpage import Manpage, bold

from pleclient import protocol as p
from pleserver import __version__
from pleserver.cli import EX_CONFIG, build_parser
from pleserver.config import CONFIG_ENV, DEFAULT_CONFIG_PATH, ENV_PREFIX
from pleserver.ops.flags import Switch

PAGE = Path(__file__).resolve().with_name("pleserver.1")
DATE = re.compile(r'^\.TH \S+ "1" "([^"]*)"', re.MULTILINE)


def roff(text: str) -> str:
    """Plain text as roff reads it literally: backslashes and hyphens escaped,
    no line starting with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line[:1] in ".'" else line for line in text.splitlines())


def entries(items: list[tuple[str, str]]) -> str:
    """A tagged list: each term in bold, its text indented below it."""
    return "\n".join(f".TP\n.B {roff(term)}\n{roff(text)}" for term, text in items)


SECTIONS: list[tuple[str, str]] = [
    (
        "environment",
        entries(
            [
                (
                    f"{ENV_PREFIX}<KEY>",
                    "Any setting, by its config file key in capitals "
                    f"({ENV_PREFIX}CACHE_SIZE=4G, {ENV_PREFIX}LOG_FORMAT=json), written as "
                    "on the command line; an empty one counts as unset. Flags override the "
                    "environment, the environment the config file, the file the defaults; "
                    "`pleserver config show` says where each value came from.",
                ),
                (
                    CONFIG_ENV,
                    "The config file, when --config names none "
                    f"(else {DEFAULT_CONFIG_PATH}, when it exists).",
                ),
                (
                    p.SOCKET_ENV,
                    "The control socket: where `serve` listens (the socket setting) and "
                    "where `stats`, `config check --against-running` and clients look for "
                    f"the server (default: {p.DEFAULT_SOCKET}).",
                ),
                (
                    "JOURNAL_STREAM",
                    "Set by systemd: when it names stderr, each log line carries a <N> "
                    "priority prefix and text lines no timestamp (the journal adds both).",
                ),
            ]
        ),
    ),
    (
        "files",
        entries(
            [
                (DEFAULT_CONFIG_PATH, "The config file (`pleserver config default` prints one)."),
                (p.DEFAULT_SOCKET, "The control socket."),
                ("/var/lib/ple-server", "The hot set, saved for the next start (state_dir)."),
            ]
        ),
    ),
    (
        "exit status",
        entries(
            [
                ("0", "Success."),
                ("1", "A check failed (config check, doctor, health) or a server did not answer."),
                ("2", "serve: the checkpoint could not be served; other commands: usage error."),
                (str(EX_CONFIG), "serve: the configuration or the command line is invalid."),
                ("130", "Ended by Ctrl-C."),
            ]
        ),
    ),
    (
        "see also",
        roff("systemctl(1), journalctl(1), systemd.service(5); ")
        + "the README and deploy/README.md of the source tree.",
    ),
]


def render(date: str) -> str:
    """The page, dated ``date``."""
    page = Manpage(build_parser())
    # A switch (--name, --no-name) takes no value: argparse-manpage would
    # print its optional legacy value as "--name []".
    plain = page.mf._format_action_invocation

    def invocation(action: argparse.Action) -> str:
        if isinstance(action, Switch):
            return ", ".join(bold(option) for option in action.option_strings)
        return plain(action)

    page.mf._format_action_invocation = invocation  # type: ignore[method-assign]
    page.date = date
    page.source = f"pleserver {__version__}"
    page.manual = "User Commands"
    page.description = "serve PLE embedding tables to vLLM workers over shared memory"
    for heading, content in SECTIONS:
        page.add_section(heading, ">", content)
    # A help line that starts with a quote would read as a roff request
    # ('none' or …): argparse-manpage leaves it, so it is escaped here.
    return "".join(
        "\\&" + line if line.startswith("'") else line for line in str(page).splitlines(True)
    )


def current(old: str | None) -> str:
    """The page as it should be: ``old``'s date while its text is the same."""
    kept = DATE.search(old or "")
    today = datetime.date.today().isoformat()
    page = render(kept.group(1).replace("\\-", "-") if kept else today)  # (roff's \- is -)
    return page if page == old or not kept else render(today)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is not current")
    args = parser.parse_args()
    old = PAGE.read_text() if PAGE.exists() else None
    page = current(old)
    if args.check:
        if page != old:
            print(f"{PAGE} is not current with the parser: run `make man`", file=sys.stderr)
            return 1
        return 0
    if page != old:
        PAGE.write_text(page)
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
