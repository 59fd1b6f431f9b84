"""Shell completion for ``pleserver``, generated from its argparse parser.

``pleserver completion bash`` and ``pleserver completion zsh`` print a script
that completes the subcommands, every option of each, and the values the
parser knows: choices (``--io``, ``--prewarm``), directories (``--model``),
files (``--socket``), users and groups (``--allow-uid``, ``--allow-gid``). What
a value is comes from the action's ``choices``, or from the ``complete``
attribute ``pleserver.flags.complete`` gives it. Nothing runs Python at
completion time: the script is static, regenerated when the CLI changes
(install it again after an upgrade).

Install:
  bash: ``pleserver completion bash > /etc/bash_completion.d/pleserver``
        (or ``~/.local/share/bash-completion/completions/pleserver``)
  zsh:  ``pleserver completion zsh > "${fpath[1]}/_pleserver"``
"""

from __future__ import annotations

import argparse
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

from pleserver.flags import Switch

SHELLS = ("bash", "zsh")


@dataclass
class Option:
    names: list[str]  # every spelling: --cache-mlock, --no-cache-mlock
    help: str
    takes_value: bool
    repeatable: bool
    value: tuple[Any, ...]  # ("choices", [...]), ("dir",), ("file",), ("user",), ("group",), ()
    metavar: str
    switch: bool = False


@dataclass
class Command:
    words: list[str]  # ["pleserver", "config", "check"]
    help: str
    options: list[Option] = field(default_factory=list)
    positionals: list[Option] = field(default_factory=list)
    subcommands: dict[str, Command] = field(default_factory=dict)

    def walk(self):
        yield self
        for sub in self.subcommands.values():
            yield from sub.walk()


def _value(action: argparse.Action) -> tuple[Any, ...]:
    if action.choices is not None and not isinstance(action.choices, dict):
        return ("choices", [str(c) for c in action.choices])
    return tuple(getattr(action, "complete", ()))


def _value_name(action: argparse.Action) -> str:
    """What an option's value is called: its metavar, or (choices) its name."""
    metavar = action.metavar
    if isinstance(metavar, str) and metavar and not metavar.startswith("{"):
        return metavar
    return action.dest


def _first_sentence(text: str | None) -> str:
    """An option's help, short: its first sentence, without the notes on its default."""
    text = " ".join((text or "").split())
    text = re.sub(r"%\((\w+)\)s", r"\1", text).replace("%%", "%")
    text = re.sub(r"\s*\((default|repeatable)\b[^)]*\)", "", text)
    match = re.match(r"(.+?)[.;](\s|$)", text)
    text = match.group(1) if match else text
    return text if len(text) <= 90 else text[:89].rstrip() + "…"


def command_tree(parser: argparse.ArgumentParser, words: list[str] | None = None) -> Command:
    """What the completion scripts need to know of ``parser``, recursively."""
    command = Command(words or [parser.prog.split()[0]], _first_sentence(parser.description))
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                child = command_tree(sub, [*command.words, name])
                child.help = _first_sentence(helps.get(name)) or child.help
                command.subcommands[name] = child
        elif action.option_strings:
            command.options.append(
                Option(
                    list(action.option_strings),
                    _first_sentence(action.help),
                    takes_value=action.nargs != 0 and not isinstance(action, Switch),
                    repeatable=isinstance(action, argparse._AppendAction),
                    value=_value(action),
                    metavar=_value_name(action),
                    switch=isinstance(action, Switch),
                )
            )
        else:
            command.positionals.append(
                Option(
                    [action.dest],
                    _first_sentence(action.help),
                    takes_value=True,
                    repeatable=action.nargs in ("*", "+"),
                    value=_value(action),
                    metavar=str(action.metavar or action.dest),
                    switch=action.nargs == "?",  # optional positional
                )
            )
    return command


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser`` for ``shell`` (one of ``SHELLS``)."""
    tree = command_tree(parser)
    if shell == "bash":
        return _bash(tree)
    if shell == "zsh":
        return _zsh(tree)
    raise ValueError(f"no completion for {shell!r}: one of {', '.join(SHELLS)}")


# ----------------------------------------------------------------------- bash
def _bash_words(words: list[str], indent: int) -> str:
    """``words`` as one double-quoted bash string, wrapped (compgen -W splits it)."""
    lines = textwrap.wrap(" ".join(words), 88 - indent, break_on_hyphens=False)
    return '"' + ("\n" + " " * indent).join(lines) + '"'


def _bash_values(value: tuple[Any, ...], indent: int) -> str:
    """The bash that fills COMPREPLY with a value's candidates for ``$cur``."""
    kind = value[0] if value else ""
    if kind == "choices":
        return f"_pleserver_reply -W {_bash_words(value[1], indent)}"
    flag = {"dir": "-d", "file": "-f", "user": "-u", "group": "-g"}.get(kind)
    if flag in ("-d", "-f"):
        return f"compopt -o filenames 2>/dev/null; _pleserver_reply {flag}"
    if flag:
        return f"_pleserver_reply {flag}"
    return "COMPREPLY=()"


def _bash(tree: Command) -> str:
    name = tree.words[0]
    descend, valued, values, words = [], [], [], []
    for cmd in tree.walk():
        key = " ".join(cmd.words)
        for sub in cmd.subcommands:
            descend.append(f'        "{key}:{sub}") cmd="{key} {sub}" ;;')
        takes_value = [n for opt in cmd.options if opt.takes_value for n in opt.names]
        if takes_value:
            lines = textwrap.wrap(" ".join(takes_value), 74, break_on_hyphens=False)
            valued.append(f'        "{key}") echo ' + " \\\n              ".join(lines) + " ;;")
        for opt in cmd.options:
            if opt.takes_value and opt.value:
                pattern = "|".join(f'"{key}:{n}"' for n in opt.names)
                values.append(f"        {pattern}) {_bash_values(opt.value, 12)}; return ;;")
        options = [n for opt in cmd.options for n in opt.names]
        if cmd.subcommands:
            rest = f"_pleserver_reply -W {_bash_words(list(cmd.subcommands), 12)}"
        elif cmd.positionals:
            rest = _bash_values(cmd.positionals[0].value, 12)
        else:
            rest = "COMPREPLY=()"
        words.append(
            f'        "{key}")\n'
            f"            if [[ $cur == -* ]]; then\n"
            f"                _pleserver_reply -W {_bash_words(options, 16)}\n"
            f"            else\n"
            f"                {rest}\n"
            f"            fi ;;"
        )
    return f"""# bash completion for {name}: generated by `{name} completion bash`.
# Install: {name} completion bash > /etc/bash_completion.d/{name}

# Candidates for $cur (of the caller), one a line: names with spaces stay whole.
_pleserver_reply() {{
    mapfile -t COMPREPLY < <(compgen "$@" -- "$cur")
}}

# The options of a command that take a value.
_pleserver_valued() {{
    case "$1" in
{chr(10).join(valued)}
    esac
}}

_pleserver() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="" cmd="{name}" word skip=0 i
    (( COMP_CWORD > 0 )) && prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    # --opt=value: bash splits it at the "=".
    if [[ $cur == "=" ]]; then
        cur=""
    elif [[ $prev == "=" ]]; then
        prev="${{COMP_WORDS[COMP_CWORD-2]}}"
    fi
    # The words before the cursor: subcommands descend, an option's value is skipped.
    for (( i = 1; i < COMP_CWORD; i++ )); do
        word="${{COMP_WORDS[i]}}"
        if (( skip )) || [[ $word == "=" ]]; then skip=0; continue; fi
        case "$cmd:$word" in
{chr(10).join(descend)}
        *:-*) [[ " $(_pleserver_valued "$cmd") " == *" $word "* ]] && skip=1 ;;
        esac
    done
    # The value of the option before the cursor.
    if [[ $prev == -* && " $(_pleserver_valued "$cmd") " == *" $prev "* ]]; then
        case "$cmd:$prev" in
{chr(10).join(values)}
        esac
        COMPREPLY=()
        return
    fi
    case "$cmd" in
{chr(10).join(words)}
    esac
}}

complete -F _pleserver {name}
"""


# ------------------------------------------------------------------------ zsh
def _zq(text: str) -> str:
    """``text`` in zsh single quotes."""
    return "'" + text.replace("'", "'\\''") + "'"


def _zdesc(text: str) -> str:
    return re.sub(r"([\[\]\\:])", r"\\\1", text)


def _zaction(opt: Option) -> str:
    kind = opt.value[0] if opt.value else ""
    if kind == "choices":
        return "(" + " ".join(opt.value[1]) + ")"
    return {
        "dir": "_files -/",
        "file": "_files",
        "user": "_users",
        "group": "_groups",
    }.get(kind, " ")


def _zsh_option(opt: Option) -> list[str]:
    specs = []
    for spelling in opt.names:
        exclusive = "(- *)" if spelling in ("-h", "--help", "--version") else ""
        if opt.switch:
            exclusive = "(" + " ".join(n for n in opt.names if n != spelling) + ")"
        spec = f"{exclusive}{'*' if opt.repeatable else ''}{spelling}"
        if opt.takes_value:
            spec += f"=[{_zdesc(opt.help)}]:{_zdesc(opt.metavar.lower())}:{_zaction(opt)}"
        else:
            spec += f"[{_zdesc(opt.help)}]"
        specs.append(_zq(spec))
    return specs


def _zfunction(cmd: Command) -> str:
    fname = "_" + "_".join(w.replace("-", "_") for w in cmd.words)
    specs = [s for opt in cmd.options for s in _zsh_option(opt)]
    for position, arg in enumerate(cmd.positionals, 1):
        optional = ":" if arg.switch else ""
        desc = _zdesc(arg.help or arg.metavar)
        specs.append(_zq(f"{position}:{optional}{desc}:{_zaction(arg)}"))
    lines = [f"{fname}() {{"]
    if not cmd.subcommands:
        body = " \\\n    ".join(specs)
        lines += [f"  _arguments -s \\\n    {body}", "}"]
        return "\n".join(lines)
    commands = "\n".join(
        f"        {_zq(f'{name}:{_zdesc(sub.help)}')}" for name, sub in cmd.subcommands.items()
    )
    cases = "\n".join(
        f"        {name}) {fname}_{name.replace('-', '_')} && ret=0 ;;" for name in cmd.subcommands
    )
    body = " \\\n    ".join([*specs, "'1:command:->command'", "'*::arg:->args'"])
    lines += [
        '  local curcontext="$curcontext" state state_descr line ret=1',
        "  typeset -A opt_args",
        f"  _arguments -C \\\n    {body} && ret=0",
        "  case $state in",
        "    command)",
        f"      local -a commands=(\n{commands}\n      )",
        f"      _describe -t commands {_zq(' '.join(cmd.words) + ' command')} commands && ret=0 ;;",
        "    args)",
        f'      curcontext="${{curcontext%:*:*}}:{"-".join(cmd.words)}-$line[1]:"',
        "      case $line[1] in",
        cases,
        "      esac ;;",
        "  esac",
        "  return ret",
        "}",
    ]
    return "\n".join(lines)


def _zsh(tree: Command) -> str:
    name = tree.words[0]
    functions = "\n\n".join(_zfunction(cmd) for cmd in tree.walk())
    return (
        f"#compdef {name}\n"
        f"# zsh completion for {name}: generated by `{name} completion zsh`.\n"
        f'# Install: {name} completion zsh > "${{fpath[1]}}/_{name}"\n\n'
        f"{functions}\n\n"
        '# Autoloaded from $fpath: complete; sourced (eval "$(...)"): register.\n'
        f'if [[ $funcstack[1] == _{name} ]]; then\n  _{name} "$@"\nelse\n'
        f"  compdef _{name} {name}\nfi\n"
    )
