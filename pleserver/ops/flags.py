"""The command line's settings flags, generated from ``ServerConfig``'s metadata.

``add_setting_flags`` gives a parser one flag per setting
(``pleserver.config.SETTINGS``), in argument groups that are the settings'
groups (``config.GROUPS``), each with its help, its default as a person
writes it (``1G``, ``2ms``) and its choices. Switches are ``--name`` and
``--no-name``. Nothing here knows one setting from another: a new field of
``ServerConfig`` gets its flag, its group (the one of the field before it,
unless it names one) and its help from its metadata.

The flags' defaults are ``argparse.SUPPRESS``: only the flags given reach the
namespace, so that they override the config file and nothing else does.
Values are checked by ``config.load_config``, which names the flag in its
errors, not here.

Each setting's help names its environment variable too (``PLE_SERVER_<KEY>``),
as llama-server's does.

``complete`` says what an action's value is, for shell completion
(argcomplete reads the ``completer`` it sets): ``("choices", [...])``,
``("dir",)``, ``("file",)``, ``("user",)``, ``("group",)``; nothing for a
number, a size or a duration. ``Switch`` takes no value.
"""

from __future__ import annotations

import argparse
import grp
import pwd
import textwrap
from collections.abc import Sequence
from typing import Any

from pleserver.config import GROUPS, SETTINGS, Setting, parse_duration, parse_size

DEPRECATIONS = "deprecated_flags"  # namespace attribute: notes for the log


class Switch(argparse.Action):
    """``--name`` sets a switch, ``--no-name`` clears it.

    ``--name VALUE`` (``true``, ``false``, ``yes``, ...), the spelling before
    switches were flags, still works, so that units and scripts written for it
    keep starting; each use leaves a deprecation note in the namespace
    (``DEPRECATIONS``), which ``serve`` logs. The value goes on as the string
    ``"true"``, ``"false"`` or as given: the config loader checks it."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        positive = option_strings[0]
        self.positive, self.negative = positive, "--no-" + positive.removeprefix("--")
        super().__init__([positive, self.negative], dest, nargs="?", metavar="", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string == self.negative:
            if values is not None:
                parser.error(f"{self.negative} takes no value")
            value = "false"
        elif values is None:
            value = "true"
        else:
            value = values
            word = str(values).strip().lower()
            instead = (
                self.positive
                if word in ("true", "yes", "on", "1")
                else self.negative
                if word in ("false", "no", "off", "0")
                else f"{self.positive} or {self.negative}"
            )
            notes = getattr(namespace, DEPRECATIONS, None) or []
            notes.append(
                f"{self.positive} {values}: a value after a switch is deprecated; write {instead}"
            )
            setattr(namespace, DEPRECATIONS, notes)
        setattr(namespace, self.dest, value)

    def format_usage(self) -> str:
        return "--[no-]" + self.positive.removeprefix("--")


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions wrapped line by line (their line breaks kept, indented
    lines as written), words never broken at hyphens (paths); switches as
    ``--name, --no-name``; the default of an option with a value, when its
    help does not say it already."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            if not line.strip() or line[0].isspace():
                lines.append(indent + line if line.strip() else "")
            else:
                lines += textwrap.wrap(
                    line,
                    width,
                    initial_indent=indent,
                    subsequent_indent=indent,
                    break_on_hyphens=False,
                )
        return "\n".join(lines)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Switch):
            return f"{action.positive}, {action.negative}"
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" not in text
            and action.option_strings
            and action.nargs != 0
            and action.default not in (None, argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text


class Completer:
    """An argcomplete completer for one kind of value (``complete``).
    argcomplete itself is imported only when a shell asks for completions,
    never by a command that runs."""

    def __init__(self, *what: Any) -> None:
        self.what = what

    def __call__(self, *, prefix: str, **kwargs: Any) -> list[str]:
        kind = self.what[0] if self.what else None
        if kind == "choices":
            return [str(c) for c in self.what[1]]
        if kind in ("dir", "file"):
            from argcomplete.completers import DirectoriesCompleter, FilesCompleter

            files = DirectoriesCompleter() if kind == "dir" else FilesCompleter()
            return list(files(prefix=prefix, **kwargs))
        if kind == "user":
            return sorted({u.pw_name for u in pwd.getpwall()})
        if kind == "group":
            return sorted({g.gr_name for g in grp.getgrall()})
        return []  # a number, a size, a duration: nothing to offer


def complete(action: argparse.Action, *what: Any) -> argparse.Action:
    """Say what ``action``'s value is, for shell completion; returns it."""
    action.completer = Completer(*what)  # type: ignore[attr-defined]
    return action


def duration_type(unit: str = "s", minimum: float = 0.0):
    """An argparse ``type`` for a duration in ``unit`` (``2``, ``500ms``)."""

    def parse(text: str) -> float:
        try:
            value = parse_duration(text, unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g} {unit}, got {text!r}")
        return value

    parse.__name__ = "duration"
    return parse


def size_type(text: str) -> int:
    """An argparse ``type`` for a size in bytes or with a binary unit (``16G``)."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size is not negative, got {text!r}")
    return value


size_type.__name__ = "size"


def _metavar(s: Setting) -> str | None:
    if s.kind == "bool":
        return None
    if s.kind == "choice":
        return "{" + ",".join(s.choices) + "}"
    if s.metavar:
        return s.metavar
    return {"size": "SIZE", "duration": "DURATION", "int": "N", "float": "NUMBER"}.get(
        s.kind, s.name.split("_")[-1].upper()
    )


def _help(s: Setting) -> str:
    notes = []
    if s.default == "":  # required (model): no default to show
        return f"{s.help} (env: {s.env})"
    if s.repeatable:
        notes.append("repeatable")
    if s.kind == "duration":
        unit = "µs" if s.unit == "us" else s.unit
        notes.append(f"default: {s.format(s.default)}; a bare number is in {unit}")
    else:
        notes.append(f"default: {s.format(s.default)}")
    notes.append(f"env: {s.env}")
    return f"{s.help} ({'; '.join(notes)})"


def _completion(s: Setting) -> tuple[Any, ...]:
    if s.kind == "choice":
        return ("choices", list(s.choices))
    return {
        "path": ("dir",),
        "socket": ("file",),
        "uids": ("user",),
        "gids": ("group",),
    }.get(s.kind, ())


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in one argument group per settings group."""
    for key, (title, description) in GROUPS.items():
        members = [s for s in SETTINGS.values() if s.group == key]
        if not members:
            continue
        group = parser.add_argument_group(title, description)
        for s in members:
            kwargs: dict[str, Any] = {
                "dest": s.name,
                "default": argparse.SUPPRESS,
                "help": _help(s),
            }
            if s.kind == "bool":
                kwargs["action"] = Switch
            else:
                kwargs["action"] = "append" if s.repeatable else "store"
                kwargs["metavar"] = _metavar(s)
            complete(group.add_argument(s.flag, **kwargs), *_completion(s))


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave (setting name → raw value)."""
    return {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}


def deprecations(args: argparse.Namespace) -> list[str]:
    """The deprecation notes parsing left (old spellings that still work)."""
    return list(getattr(args, DEPRECATIONS, None) or [])
