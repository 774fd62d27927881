"""``ssdrbm completion bash|zsh|fish``: a shell completion script made from the argument parser.

The script lists the commands, each command's options and the values of options that take a
fixed set of them, as the parser defines them now; regenerate it after upgrading ssdrbm.
Everything else (job ids, files) is left to the shell's default completion.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from ssdrbm.cli.exit_codes import ExitCode

SHELLS = ("bash", "zsh", "fish")
PROGRAM = "ssdrbm"
# Words the scripts may contain unquoted; anything else (never seen so far) is left out.
_SAFE_WORD = re.compile(r"[A-Za-z0-9_.:=+/-]+")


@dataclass
class Command:
    """What completion needs to know about one command (the root parser is the command "")."""

    name: str
    help: str = ""
    options: list[str] = field(default_factory=list)
    option_help: dict[str, str] = field(default_factory=dict)
    option_takes_value: set[str] = field(default_factory=set)
    option_choices: dict[str, list[str]] = field(default_factory=dict)
    positional_choices: list[str] = field(default_factory=list)


def register(
    commands: argparse._SubParsersAction, parents: list, root: argparse.ArgumentParser
) -> None:
    """Add ``completion`` to `root`, the ``ssdrbm`` parser whose commands the script lists."""
    completion = commands.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh or fish)",
        description="Print a completion script for SHELL on stdout. bash: add "
        "'source <(ssdrbm completion bash)' to ~/.bashrc; zsh: "
        "'source <(ssdrbm completion zsh)' to ~/.zshrc (after compinit); fish: "
        "'ssdrbm completion fish > ~/.config/fish/completions/ssdrbm.fish'.",
    )
    completion.add_argument("shell", choices=SHELLS, metavar="SHELL", help=", ".join(SHELLS))
    # The script is made from `root` when the command runs, so every command is in it by then.
    completion.set_defaults(run=functools.partial(run_completion, parser=root))


def run_completion(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExitCode:
    """Print the script for ``args.shell``, made from `parser`."""
    sys.stdout.write(script(args.shell, parser))
    return ExitCode.OK


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for ``shell`` (one of :data:`SHELLS`)."""
    root, commands = describe_parser(parser)
    return {"bash": bash_script, "zsh": zsh_script, "fish": fish_script}[shell](root, commands)


def _safe(words: Iterable[object]) -> list[str]:
    return [str(word) for word in words if _SAFE_WORD.fullmatch(str(word))]


def _describe(name: str, parser: argparse.ArgumentParser, help_text: str) -> Command:
    command = Command(name=name, help=help_text)
    for action in parser._actions:
        if action.help is argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        if not action.option_strings:
            command.positional_choices += _safe(action.choices or ())
            continue
        for flag in _safe(action.option_strings):
            command.options.append(flag)
            command.option_help[flag] = str(action.help or "")
            if action.nargs != 0:
                command.option_takes_value.add(flag)
            if action.choices:
                command.option_choices[flag] = _safe(action.choices)
    return command


def describe_parser(parser: argparse.ArgumentParser) -> tuple[Command, list[Command]]:
    """The root's own options, and each command with its options."""
    root = _describe("", parser, parser.description or "")
    commands: list[Command] = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: str(choice.help or "") for choice in action._choices_actions}
        for name, subparser in action.choices.items():
            if "-" not in subparser.prefix_chars:
                # serve/worker hand every argument to the server: nothing of ours to complete.
                commands.append(Command(name=name, help=helps.get(name, "")))
                continue
            commands.append(_describe(name, subparser, helps.get(name, "")))
    return root, commands


# -- bash (and zsh through bashcompinit) --------------------------------------------------------

_BASH_TEMPLATE = """\
# {program} completion for bash. Load it from ~/.bashrc with:
#   source <({program} completion bash)
_{program}() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev="" command="" words="" i
    (( COMP_CWORD > 0 )) && prev=${{COMP_WORDS[COMP_CWORD-1]}}
    for (( i = 1; i < COMP_CWORD; i++ )); do
        case " {commands} " in
            *" ${{COMP_WORDS[i]}} "*) command=${{COMP_WORDS[i]}}; break ;;
        esac
    done
    case "$command $prev" in
{value_cases}
    esac
    if [[ $cur == -* ]]; then
        case "$command" in
{option_cases}
        esac
    elif [[ -z $command ]]; then
        words="{commands}"
    else
        case "$command" in
{positional_cases}
        esac
    fi
    [[ -n $words ]] && COMPREPLY=($(compgen -W "$words" -- "$cur"))
    return 0
}}
complete -o default -F _{program} {program}
"""


def bash_script(root: Command, commands: list[Command]) -> str:
    """A bash completion function; with no suggestion the shell completes file names."""
    value_cases, option_cases, positional_cases = [], [], []
    for command in [root, *commands]:
        options = sorted(set(command.options) | set(root.options))
        pattern = f'"{command.name}"' if command.name else '""'
        option_cases.append(f'            {pattern}) words="{" ".join(options)}" ;;')
        if command.positional_choices:
            words = " ".join(command.positional_choices)
            positional_cases.append(f'            {pattern}) words="{words}" ;;')
        for flag, choices in command.option_choices.items():
            value_cases.append(
                f'        "{command.name} {flag}") COMPREPLY=($(compgen -W "{" ".join(choices)}" '
                f'-- "$cur")); return 0 ;;'
            )
        for flag in sorted(command.option_takes_value - set(command.option_choices)):
            # A value of the user's own (a number, a path, an address): the shell's default.
            value_cases.append(f'        "{command.name} {flag}") return 0 ;;')
    for flag in sorted(root.option_takes_value):
        value_cases.append(f'        *" {flag}") return 0 ;;')
    return _BASH_TEMPLATE.format(
        program=PROGRAM,
        commands=" ".join(command.name for command in commands),
        value_cases="\n".join(value_cases) or "        *) ;;",
        option_cases="\n".join(option_cases),
        positional_cases="\n".join(positional_cases) or "            *) ;;",
    )


def zsh_script(root: Command, commands: list[Command]) -> str:
    """The bash function run by zsh's bash completion emulation."""
    return (
        f"#compdef {PROGRAM}\n"
        f"# {PROGRAM} completion for zsh. Load it from ~/.zshrc, after compinit, with:\n"
        f"#   source <({PROGRAM} completion zsh)\n"
        "autoload -U +X bashcompinit && bashcompinit\n"
        + bash_script(root, commands).split("\n", 2)[2]
    )


# -- fish ---------------------------------------------------------------------------------------


def _fish_quote(text: str) -> str:
    text = " ".join(text.split())
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_flag(flag: str) -> str:
    if flag.startswith("--"):
        return f"-l {flag[2:]}"
    return f"-s {flag[1:]}" if len(flag) == 2 else f"-o {flag[1:]}"


def fish_script(root: Command, commands: list[Command]) -> str:
    """``complete`` lines for fish: commands first, then each command's options."""
    names = " ".join(command.name for command in commands)
    lines = [
        f"# {PROGRAM} completion for fish. Install it with:",
        f"#   {PROGRAM} completion fish > ~/.config/fish/completions/{PROGRAM}.fish",
        f"complete -c {PROGRAM} -e",
    ]
    # The names are spelled out: a condition runs later, where this file's variables are gone.
    before_command = f"-n 'not __fish_seen_subcommand_from {names}'"
    for command in commands:
        lines.append(
            f"complete -c {PROGRAM} -f {before_command} -a {command.name} "
            f"-d {_fish_quote(command.help)}"
        )
    for command in [root, *commands]:
        condition = f"-n '__fish_seen_subcommand_from {command.name}'" if command.name else ""
        if command.positional_choices:
            words = " ".join(command.positional_choices)
            lines.append(f"complete -c {PROGRAM} -f {condition} -a '{words}'")
        for flag in command.options:
            if command.name and flag in root.options:
                continue  # the connection options, completed everywhere by the root's lines
            parts = [f"complete -c {PROGRAM}", condition, _fish_flag(flag)]
            if flag in command.option_choices:
                parts.append(f"-x -a '{' '.join(command.option_choices[flag])}'")
            elif flag in command.option_takes_value:
                parts.append("-r")
            parts.append(f"-d {_fish_quote(command.option_help.get(flag, ''))}")
            lines.append(" ".join(part for part in parts if part))
    return "\n".join(lines) + "\n"
