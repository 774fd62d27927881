"""``ssdrbm``: train RBMs on the ssdrbm service, watch them learn and use the models.

Every command is ``ssdrbm <verb> [options]``; ``ssdrbm <verb> --help`` lists the options. Where a
command prints data, ``--json`` prints it as JSON instead. Exit codes: see ``exit_codes.py``.

Output that nobody reads any more (``ssdrbm jobs --json | head -1``) ends the command quietly with
exit code 141, as coreutils do when SIGPIPE stops them.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from ssdrbm.cli import completion, data, jobs, models, servers, sweeps
from ssdrbm.cli.context import add_connection_options, connection_from_args, option
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.funnel import Context, report
from ssdrbm.cli.version import run_version

EPILOG = """\
examples:
  ssdrbm serve &                               # service + worker (needs the server install)
  JOB=$(ssdrbm train --wait 30 --hidden 25 --steps 2000)  # waits for it; prints the job id
  ssdrbm watch $JOB                            # live progress until the job ends
  ssdrbm features $JOB --input x.npy --output h.npy
  ssdrbm plot $JOB --output figures/
  ssdrbm sweep --hidden 25 --steps 2000 --lr 1e-3,3e-3,1e-2 --seeds 3 --early-stop 200 --watch

exit codes: 0 ok, 1 error, 2 usage or invalid argument, 3 service unreachable, 4 not found,
5 unauthenticated, 6 job failed, 7 job cancelled, 8 not ready, 9 limit reached, 130 Ctrl-C,
141 output closed (| head)

shell completion: source <(ssdrbm completion bash)   (also zsh, fish)
"""


def did_you_mean(typed: str, known: Iterable[Any]) -> str:
    """`` — did you mean 'X'?`` for the known word closest to ``typed``; "" when none is close."""
    close = difflib.get_close_matches(typed, [str(word) for word in known], n=1)
    return f" — did you mean {close[0]!r}?" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse's parser, which also suggests the closest command, choice or option to a
    mistyped one (Python 3.14's ``suggest_on_error``, which 3.11 lacks)."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # The one place where argparse refuses a value outside ``choices``: commands included.
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            hint = did_you_mean(str(value), action.choices or ())
            raise argparse.ArgumentError(action, error.message + hint) from None

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            message = f"unrecognized arguments: {' '.join(extras)}"
            self.error(message + self._option_hint(extras, parsed))
        return parsed

    def _option_hint(self, extras: list[str], parsed: argparse.Namespace) -> str:
        """The suggestion for the first unknown option, among the options of the command."""
        command = self._commands().get(getattr(parsed, "command", None) or "", self)
        known = [flag for action in command._actions for flag in action.option_strings]
        for extra in extras:
            if extra.startswith("-"):
                hint = did_you_mean(extra.partition("=")[0], known)
                if hint:
                    return hint
        return ""

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ssdrbm`` command."""
    parser = Parser(
        prog="ssdrbm",
        description="Train Restricted Boltzmann Machines with Stochastic Spectral Descent.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="store_true",
        help="show the client's version and the service's (when it answers), and exit",
    )
    add_connection_options(parser)
    common = argparse.ArgumentParser(add_help=False)
    add_connection_options(common)
    # Not required by argparse, so that --version works alone; main() asks for one otherwise.
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (servers, jobs, sweeps, data, models):
        module.register(commands, [common])
    completion.register(commands, [common], parser)
    return parser


def _context(args: argparse.Namespace) -> Context:
    try:
        target = connection_from_args(args).target
    except Exception:  # the context only decorates messages; never fail because of it
        target = option(args, "target") or ""
    return Context(command=args.command or "", target=target, job_id=getattr(args, "job", None))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``ssdrbm`` command and return its exit code (see :class:`ExitCode`)."""
    try:
        return _run(argv)
    except BrokenPipeError:
        return _output_closed()


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not args.version and args.command is None:
            parser.error("the following arguments are required: COMMAND")
    except SystemExit as exit_:  # argparse prints its own message; 2 for usage errors
        return int(exit_.code or 0)
    try:
        code = int(run_version(args) if args.version else args.run(args))
        sys.stdout.flush()  # a closed pipe shows here, not at exit after the code is returned
        return code
    except BaseException as error:  # the one funnel: a line on stderr and an exit code
        if isinstance(error, SystemExit | BrokenPipeError):
            raise
        return int(report(error, _context(args), debug=bool(option(args, "debug"))))


def _output_closed() -> int:
    """The reader of stdout went away: stop without a message or a traceback.

    What is still buffered for stdout can never be written; stdout is pointed at /dev/null so
    that flushing it at exit does not fail again (and print "Exception ignored ...").
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (tests, embedding)
        pass
    return int(ExitCode.BROKEN_PIPE)


if __name__ == "__main__":
    sys.exit(main())
