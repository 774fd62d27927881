"""``ssdrbm``: train RBMs on the ssdrbm service, watch them learn and use the models.

Every command is ``ssdrbm <verb> [options]``; ``ssdrbm <verb> --help`` lists the options. Where a
command prints data, ``--json`` prints it as JSON instead. Exit codes: see ``exit_codes.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ssdrbm import __version__
from ssdrbm.cli import data, jobs, models, servers
from ssdrbm.cli.context import add_connection_options, connection_from_args, option
from ssdrbm.cli.funnel import Context, report

EPILOG = """\
examples:
  ssdrbm serve &                               # service + worker (needs ssdrbm-server)
  JOB=$(ssdrbm train --hidden 25 --steps 2000) # prints the job id
  ssdrbm watch $JOB                            # live progress until the job ends
  ssdrbm features $JOB --input x.npy --output h.npy
  ssdrbm plot $JOB --output figures/

exit codes: 0 ok, 1 error, 2 usage or invalid argument, 3 service unreachable, 4 not found,
5 unauthenticated, 6 job failed, 7 job cancelled, 8 not ready, 9 limit reached, 130 Ctrl-C
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ssdrbm`` command."""
    parser = argparse.ArgumentParser(
        prog="ssdrbm",
        description="Train Restricted Boltzmann Machines with Stochastic Spectral Descent.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ssdrbm {__version__}")
    add_connection_options(parser)
    common = argparse.ArgumentParser(add_help=False)
    add_connection_options(common)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    servers.register(commands, [common])
    jobs.register(commands, [common])
    data.register(commands, [common])
    models.register(commands, [common])
    return parser


def _context(args: argparse.Namespace) -> Context:
    try:
        target = connection_from_args(args).target
    except Exception:  # the context only decorates messages; never fail because of it
        target = option(args, "target") or ""
    return Context(command=args.command or "", target=target, job_id=getattr(args, "job", None))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``ssdrbm`` command and return its exit code (see :class:`ExitCode`)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse prints its own message; 2 for usage errors
        return int(exit_.code or 0)
    try:
        return int(args.run(args))
    except BaseException as error:  # the one funnel: a line on stderr and an exit code
        if isinstance(error, SystemExit):
            raise
        return int(report(error, _context(args), debug=bool(option(args, "debug"))))


if __name__ == "__main__":
    sys.exit(main())
