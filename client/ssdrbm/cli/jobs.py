"""Commands about jobs: ``train``, ``watch``, ``jobs``, ``get``, ``cancel``, ``delete``."""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
from typing import Any

from ssdrbm import spec
from ssdrbm.cli.context import add_command, argument, client_from_args, json_flag
from ssdrbm.cli.data import submit_and_follow
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.funnel import UsageError
from ssdrbm.cli.names import find_job, job_id
from ssdrbm.cli.output import print_listing, print_result
from ssdrbm.cli.progress import JsonLines, ProgressDisplay, QueueWatch
from ssdrbm.cli.tables import defaults_table, job_details, jobs_table
from ssdrbm.client import Client
from ssdrbm.events import JobState

MAX_PAGE_SIZE = 1000  # the service's largest page

FINAL_EXIT_CODES = {
    JobState.SUCCEEDED: ExitCode.OK,
    JobState.FAILED: ExitCode.JOB_FAILED,
    JobState.CANCELLED: ExitCode.JOB_CANCELLED,
    JobState.STOPPED: ExitCode.OK,  # ended by its sweep's early stopping: an expected outcome
}


JOB_HELP = "a job id, or the name of one of your jobs"


JOB = argument("job", metavar="JOB", help=JOB_HELP)
JSON_JOB = json_flag("print the job as JSON")


def register(commands: argparse._SubParsersAction, parents: list) -> None:
    add = functools.partial(add_command, commands, parents)
    train = add("train", "submit a training job and print its id", run_train)
    _add_training_options(train)
    train.add_argument("--watch", action="store_true", help="follow the job until it ends")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve and check the job on the server and show it, without creating it",
    )
    train.add_argument("--json", action="store_true", help="print the job as JSON")
    defaults_help = "show the server's defaults for unset training options"
    add("defaults", defaults_help, run_defaults, json_flag("print them as JSON"))
    watch = add("watch", "follow a job's progress live", run_watch, JOB)
    watch.add_argument("--after", metavar="TOKEN", help="start after this resume token")
    watch.add_argument("--json", action="store_true", help="print events as JSON lines")
    jobs = add("jobs", "list jobs, newest first", run_jobs)
    jobs.add_argument("--state", choices=[s.value for s in JobState if s.value != "unspecified"])
    add_listing_options(jobs)
    add("get", "show one job", run_get, JOB, JSON_JOB)
    add("cancel", "stop a job", run_cancel, JOB, JSON_JOB)
    force = argument("--force", action="store_true", help="cancel a queued or running job first")
    add("delete", "delete a finished job, its metrics and checkpoints", run_delete, JOB, force)


TRAINING_EPILOG = (
    "Options left out are sent unset and take the server's defaults: 'ssdrbm defaults' lists "
    "them (step sizes per model and optimizer included), and 'ssdrbm train ... --dry-run' "
    "shows the job exactly as it would run."
)
SERVER_DEFAULT = " [server default]"


def _add_training_options(parser: argparse.ArgumentParser) -> None:
    parser.epilog = TRAINING_EPILOG
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=list(spec.MODELS), help="[bernoulli]")
    model.add_argument("--variance", choices=list(spec.VARIANCES), help="Gaussian models")
    model.add_argument("--min-variance", type=float, help="Gaussian: variance floor")
    model.add_argument(
        "--hidden", "--n-hidden", dest="n_hidden", type=int, help="hidden units (required)"
    )
    opt = parser.add_argument_group("optimizer")
    opt.add_argument("--optimizer", choices=list(spec.OPTIMIZERS), help="[ssd]")
    opt.add_argument("--method", choices=list(spec.METHODS), help="SSD polar method [auto]")
    opt.add_argument("--preconditioner", choices=list(spec.PRECONDITIONERS))
    opt.add_argument("--lr", type=float, help="step size [the server's, per model and optimizer]")
    opt.add_argument("--momentum", type=float, help="[0; 0.9 for nesterov]")
    opt.add_argument("--weight-decay", type=float, help=SERVER_DEFAULT.strip())
    opt.add_argument("--max-spectral-norm", type=float, help="bound on ||W||2 [unbounded]")
    opt.add_argument("--rank", type=int, help="randomized method's sketch rank [automatic]")
    opt.add_argument(
        "--step-rule",
        choices=list(spec.STEP_RULES),
        help="SSD step length: paper (lr·||σ(G)||1) or normalized (the SGD step's length, one lr "
        "for every model size; its own default lr) [paper]",
    )
    opt.add_argument(
        "--schedule",
        metavar="KIND[,X[,Y]]",
        help="step-size schedule: constant, exponential[,RATE[,STEPS]], inverse-time[,STEPS], "
        "cosine[,FLOOR[,HORIZON]] [constant]",
    )
    opt.add_argument("--warmup-steps", type=int, help="linear step-size warmup [0]")
    opt.add_argument(
        "--per-parameter",
        action="append",
        default=[],
        metavar="NAME=OPTIMIZER",
        help="hybrid override, e.g. W=ssd (repeatable)",
    )
    opt.add_argument(
        "--per-parameter-lr",
        action="append",
        default=[],
        metavar="NAME=LR",
        help="step size of one parameter, e.g. W=0.001 (repeatable)",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--cd-k", type=int, help="Gibbs steps per gradient [1]")
    train.add_argument("--persistent", action="store_true", default=None, help="PCD instead of CD")
    train.add_argument(
        "--centered",
        action="store_true",
        default=None,
        help="centered RBM training (offsets from the data and hidden means)",
    )
    train.add_argument(
        "--centering-sliding-factor",
        type=float,
        metavar="NU",
        help="how far the offsets move per step, in [0, 1] (with --centered)" + SERVER_DEFAULT,
    )
    train.add_argument(
        "--tempering",
        metavar="K[,BETA_MIN]",
        help="parallel tempering of the PCD chains: K temperatures (0: the server's default) "
        "down to inverse temperature BETA_MIN; needs --persistent",
    )
    train.add_argument("--batch-size", type=int, help=SERVER_DEFAULT.strip())
    length = train.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="iterations" + SERVER_DEFAULT)
    length.add_argument("--epochs", type=int)
    train.add_argument("--seed", type=int, help="[0]")
    train.add_argument("--checkpoint-every", type=int, help=SERVER_DEFAULT.strip())
    train.add_argument(
        "--max-backoffs",
        type=int,
        help="blow-ups to recover from by rolling back with smaller steps (0: fail at once)"
        + SERVER_DEFAULT,
    )
    train.add_argument(
        "--backoff-factor", type=float, help="each backoff divides the step sizes by it"
    )
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval-every", type=int, help="steps between metrics")
    evaluation.add_argument("--ais", action="store_true", default=None, help="AIS log-likelihood")
    evaluation.add_argument("--ais-chains", type=int)
    evaluation.add_argument("--ais-betas", type=int)
    evaluation.add_argument("--validation-fraction", type=float)
    data = parser.add_argument_group("data")
    source = data.add_mutually_exclusive_group()
    source.add_argument("--dataset", help="synthetic, mnist or freyface [synthetic]")
    source.add_argument("--dataset-id", help="an id from 'ssdrbm upload'")
    source.add_argument("--data", metavar="FILE.npy", help="upload this array and train on it")
    data.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="built-in dataset option, e.g. n_samples=2000 (repeatable)",
    )
    data.add_argument(
        "--preprocess",
        choices=list(spec.PREPROCESSING),
        help="[binarize images for bernoulli, standardize them for gaussian; none otherwise]",
    )
    parser.add_argument("--name", help="label shown in listings")
    parser.add_argument("--request-id", help="idempotency key (generated when missing)")


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    result = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} expects KEY=VALUE, got {item!r}")
        result[key] = value
    return result


def _step_sizes(values: list[str]) -> dict[str, float]:
    result = {}
    for key, value in _pairs(values, "--per-parameter-lr").items():
        try:
            result[key] = float(value)
        except ValueError:
            raise UsageError(f"--per-parameter-lr {key}= expects a number, got {value!r}") from None
    return result


def _tempering(value: str | None) -> dict[str, Any]:
    """--tempering K[,BETA_MIN] as start_training's ``tempering`` and ``tempering_min_beta``."""
    if value is None:
        return {}
    count, _, beta = value.partition(",")
    try:
        result: dict[str, Any] = {"tempering": int(count)}
        if beta:
            result["tempering_min_beta"] = float(beta)
    except ValueError:
        raise UsageError(
            f"--tempering expects K[,BETA_MIN], e.g. 8 or 8,0.3; got {value!r}"
        ) from None
    return result


def training_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The :meth:`Client.start_training` arguments given on the command line: each parameter of
    :func:`ssdrbm.spec.training_request` is the option of the same name (None where there is
    none), but for those parsed here; ``validate_only`` is the submit's own."""
    parsed = {
        "per_parameter": _pairs(args.per_parameter, "--per-parameter") or None,
        "per_parameter_lr": _step_sizes(args.per_parameter_lr) or None,
        **_tempering(args.tempering),
        "dataset_options": _pairs(args.option, "--option") or None,
    }
    names = inspect.signature(spec.training_request).parameters
    given = {name: getattr(args, name, None) for name in names if name != "validate_only"}
    return {**given, **parsed}


def run_train(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm train``: print the new job's id (or JSON); ``--watch`` then follows it."""

    def follow_new(client: Client, new_job_id: str, *, as_json: bool) -> ExitCode:
        args.job = new_job_id  # lets an error or Ctrl-C name the job
        return follow(client, new_job_id, as_json=as_json)

    kwargs = training_kwargs(args)
    return submit_and_follow(args, Client.start_training, kwargs, job_details, follow_new)


def follow(client: Client, job_id: str, *, as_json: bool, after: str | None = None) -> ExitCode:
    """Stream a job's events (progress on stderr, or JSON lines on stdout) until it ends; while
    it is queued, its place in the queue too (read every few seconds: QueueWatch)."""
    display = JsonLines(job_id) if as_json else ProgressDisplay(job_id)
    display.start(client.get_job(job_id))  # the total and the place known before any event
    with QueueWatch(lambda: client.get_job(job_id), lambda: display.queued, display.on_queue):
        for event in client.stream_metrics(job_id, after=after):
            display.on_event(event)
    job = client.get_job(job_id)
    display.finish(job)
    return FINAL_EXIT_CODES.get(job.state, ExitCode.ERROR)


def run_defaults(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm defaults``: the step-size table and the other defaults of the server."""
    with client_from_args(args) as client:
        defaults = client.training_defaults()
    print_result(defaults, args.json, defaults_table)
    return ExitCode.OK


def run_watch(args: argparse.Namespace) -> ExitCode:
    with client_from_args(args) as client:
        args.job = job_id(client, args.job)
        return follow(client, args.job, as_json=args.json, after=args.after)


def add_listing_options(parser: argparse.ArgumentParser) -> None:
    """``--limit N`` and ``--json`` of the listing commands (``jobs``, ``sweeps``)."""
    parser.add_argument("--limit", type=int, default=50, help="at most this many (0 = all)")
    parser.add_argument("--json", action="store_true", help="print a JSON list")


def limited_page_size(limit: int) -> int:
    """The page size to fetch the first ``--limit`` items (0: all) with; refuses a negative
    limit (before anything is sent)."""
    if limit < 0:
        raise UsageError("--limit must be 0 (all) or more")
    return min(limit, MAX_PAGE_SIZE) if limit else MAX_PAGE_SIZE


def run_jobs(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm jobs``: a table (or JSON list) of jobs."""
    page_size = limited_page_size(args.limit)
    with client_from_args(args) as client:
        listing = client.list_jobs(args.state, page_size=page_size)
        jobs = list(itertools.islice(listing, args.limit or None))
    empty = "no jobs yet — start one with 'ssdrbm train'"
    if args.state:
        empty = f"no {args.state} jobs — 'ssdrbm jobs' lists them all"
    print_listing(jobs, args.json, jobs_table, empty)
    return ExitCode.OK


def run_get(args: argparse.Namespace) -> ExitCode:
    with client_from_args(args) as client:
        job = find_job(client, args.job)
    print_result(job, args.json, job_details)
    return ExitCode.OK


def run_delete(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm delete JOB [--force]``: removes the job; prints its id."""
    with client_from_args(args) as client:
        args.job = job_id(client, args.job)
        client.delete_job(args.job, force=args.force)
    print(f"{args.job} deleted")
    return ExitCode.OK


def run_cancel(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm cancel JOB``: the job's state after the request."""
    with client_from_args(args) as client:
        args.job = job_id(client, args.job)
        job = client.cancel(args.job)
    print_result(job, args.json, lambda job: f"{job.id} {job.state.value}")
    return ExitCode.OK
