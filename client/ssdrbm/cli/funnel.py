"""The one place where failures become a line on stderr and an exit code.

Every error is printed as ``ssdrbm: error: <what happened> — <what to do>``; the traceback is
shown only with ``--debug``.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass

from ssdrbm import errors
from ssdrbm.cli.exit_codes import ExitCode

PROGRAM = "ssdrbm"


class ServerNotInstalled(Exception):
    """``ssdrbm serve`` / ``ssdrbm worker`` need the server package, which is not importable."""


class MissingExtra(Exception):
    """A command needs an optional dependency (an extra of the package) that is not installed."""

    def __init__(self, extra: str, module: str) -> None:
        super().__init__(f"{module} is not installed (the [{extra}] extra)")
        self.extra = extra
        self.module = module


# How to install from a checkout of the repository (neither distribution is on a package index).
INSTALL_SERVER = (
    "pip install . ./client ./server (or ./scripts/install) in a checkout of the ssdrbm repository"
)


class UsageError(Exception):
    """A command-line value that cannot work, found before anything was sent."""


@dataclass(frozen=True)
class Failure:
    """What to print and what to return for an error."""

    what: str
    todo: str
    code: ExitCode

    def line(self) -> str:
        """The single stderr line."""
        return f"{PROGRAM}: error: {self.what} — {self.todo}"


@dataclass(frozen=True)
class Context:
    """What the command was doing, so the message can name the address, job and command."""

    command: str = ""
    target: str = ""
    job_id: str | None = None


def describe(error: BaseException, context: Context) -> Failure:
    """Map an exception to its message and exit code."""
    if isinstance(error, KeyboardInterrupt):
        todo = "nothing was changed"
        if context.job_id and context.command in ("watch", "train"):
            todo = f"the job keeps running; stop it with '{PROGRAM} cancel {context.job_id}'"
        return Failure("interrupted", todo, ExitCode.INTERRUPTED)
    if isinstance(error, errors.SSDRBMError):
        return _describe_service_error(error, context)
    if isinstance(error, ServerNotInstalled):
        return Failure(
            f"'{PROGRAM} {context.command}' needs the ssdrbm server, which is not installed here",
            f"install it with {INSTALL_SERVER}, or run it where it is installed",
            ExitCode.ERROR,
        )
    if isinstance(error, MissingExtra):
        return Failure(
            f"'{PROGRAM} {context.command}' needs {error.module}, which is not installed here",
            f"install the [{error.extra}] extra: pip install './client[{error.extra}]' in a "
            "checkout of the ssdrbm repository",
            ExitCode.ERROR,
        )
    if isinstance(error, UsageError):
        return Failure(str(error), f"see '{PROGRAM} {context.command} --help'", ExitCode.USAGE)
    if isinstance(error, OSError) and error.filename is not None:
        return Failure(
            f"cannot use {error.filename}: {error.strerror or error}",
            "check the path and its permissions",
            ExitCode.ERROR,
        )
    if isinstance(error, ValueError):
        return Failure(str(error), "check the input", ExitCode.USAGE)
    return Failure(
        f"unexpected {type(error).__name__}: {error}",
        "run again with --debug to see the traceback, and report it",
        ExitCode.ERROR,
    )


# Service errors whose answer is a fixed sentence and hint ({target}, {details}, {command} and
# {program} filled in), with the exit code they end with.
_FIXED_ANSWERS: dict[type[errors.SSDRBMError], tuple[str, str, ExitCode]] = {
    errors.DeadlineExceeded: (
        "the service at {target} did not answer in time",
        "try again, or allow longer with --timeout / SSDRBM_TIMEOUT",
        ExitCode.UNAVAILABLE,
    ),
    errors.InvalidArgument: (
        "invalid argument: {details}",
        "fix that value (see '{program} {command} --help')",
        ExitCode.USAGE,
    ),
    errors.Unauthenticated: (
        "the service at {target} did not accept the request: {details}",
        "pass a valid --token or set SSDRBM_TOKEN",
        ExitCode.UNAUTHENTICATED,
    ),
    errors.PermissionDenied: (
        "not allowed: {details}",
        "use a token that may do this",
        ExitCode.UNAUTHENTICATED,
    ),
}


def _describe_service_error(error: errors.SSDRBMError, context: Context) -> Failure:
    target = error.target or context.target
    details = error.details
    if isinstance(error, errors.Unavailable) and error.reason:
        return _describe_service_unavailable(error, target)
    if isinstance(error, errors.Unavailable):
        return Failure(
            f"cannot reach the ssdrbm service at {target} ({_connection_problem(details)})",
            f"start it with '{PROGRAM} serve', point --target / SSDRBM_TARGET at a running one, "
            "or wait for one that is starting with --wait SECONDS",
            ExitCode.UNAVAILABLE,
        )
    if isinstance(error, errors.NotFound):
        return _describe_not_found(details, context)
    for kind, (what, fix, code) in _FIXED_ANSWERS.items():
        if isinstance(error, kind):
            names = {"target": target, "details": details, "command": context.command}
            return Failure(what.format(**names), fix.format(program=PROGRAM, **names), code)
    if isinstance(error, errors.FailedPrecondition):
        job = context.job_id or "JOB"
        what, fix = _what_and_fix(details)
        serving = (
            f"check the job with '{PROGRAM} get {job}'; models are served once it has a checkpoint"
        )
        return Failure(what, fix or serving, ExitCode.NOT_READY)
    if isinstance(error, errors.ResourceExhausted):
        what, fix = _what_and_fix(details)  # gRPC's own size limits say no fix
        return Failure(
            f"limit reached: {what}",
            fix or "send less at once (smaller batches or datasets) or wait for running jobs",
            ExitCode.LIMIT,
        )
    return Failure(
        f"the service at {target} failed: {details}",
        "try again; if it persists, check the server's log",
        ExitCode.ERROR,
    )


# The service's reason when it answers but its job store (Redis) does not.
JOB_STORE_UNAVAILABLE = "JOB_STORE_UNAVAILABLE"


def _describe_service_unavailable(error: errors.Unavailable, target: str) -> Failure:
    """UNAVAILABLE sent by the service itself (it carries a reason, which gRPC's own connection
    failures do not): the service is up, so say what it lacks rather than how to start it."""
    what, fix = _what_and_fix(error.details)
    if error.reason == JOB_STORE_UNAVAILABLE:
        return Failure(
            f"the ssdrbm service at {target} is up, but {what}",
            "start Redis (redis-server), or point the service's SSDRBM_REDIS_URL at a running "
            "one; the service carries on once Redis answers",
            ExitCode.UNAVAILABLE,
        )
    return Failure(
        f"the ssdrbm service at {target} is unavailable: {what}",
        fix or "try again shortly",
        ExitCode.UNAVAILABLE,
    )


def _what_and_fix(details: str) -> tuple[str, str]:
    """The service's messages say "<what happened>; <what to do>": the two parts ("" for a
    message without the second)."""
    what, _, fix = details.partition("; ")
    return what.strip(), fix.strip()


def _describe_not_found(details: str, context: Context) -> Failure:
    # The service says "<what> not found; <hint for API users>": keep the first part, and give
    # the hint in terms of commands.
    what, _ = _what_and_fix(details)
    if what.startswith("dataset"):
        todo = f"upload the data with '{PROGRAM} upload FILE' and pass the id to --dataset-id"
    elif what.startswith("sweep"):
        todo = f"list your sweeps with '{PROGRAM} sweeps'"
    else:
        todo = f"list your jobs with '{PROGRAM} jobs'"
        if context.job_id and context.job_id not in what:
            what = f"job {context.job_id} not found ({what})"
    return Failure(what, todo, ExitCode.NOT_FOUND)


def _connection_problem(details: str) -> str:
    """gRPC's connection messages are long; keep the part a person acts on."""
    for known in ("Connection refused", "Connection reset", "DNS resolution failed", "timed out"):
        if known.lower() in details.lower():
            return known.lower()
    return details if len(details) <= 120 else details[:119] + "…"


def report(error: BaseException, context: Context, *, debug: bool = False) -> ExitCode:
    """Print the error line on stderr (after the traceback with ``debug``); its exit code."""
    if debug and not isinstance(error, KeyboardInterrupt):
        traceback.print_exception(error, file=sys.stderr)
    failure = describe(error, context)
    print(failure.line(), file=sys.stderr, flush=True)
    return failure.code
