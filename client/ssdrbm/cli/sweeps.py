"""Commands about sweeps: ``sweep`` (start, ``--watch`` a live leaderboard), ``sweeps`` (list),
``sweep-show``, ``sweep-cancel``, ``sweep-delete``; ``plot SWEEP`` draws one curve per run
(models.py asks here).

``ssdrbm sweep`` takes ``ssdrbm train``'s options; the ones a sweep can vary take a comma list
(``--lr 1e-3,3e-3,1e-2 --optimizer ssd,sgd``), or with ``--random N`` a range ``LOW..HIGH``
(log-uniform for step sizes, uniform otherwise). One value is the base every run shares.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path
from typing import Any

from ssdrbm import spec
from ssdrbm.cli.context import add_command, argument, client_from_args, json_flag
from ssdrbm.cli.data import submit_and_follow
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.funnel import UsageError
from ssdrbm.cli.jobs import (
    _add_training_options,
    _pairs,
    add_listing_options,
    limited_page_size,
    training_kwargs,
)
from ssdrbm.cli.output import format_number, format_time, print_json, print_listing, print_result
from ssdrbm.cli.tables import render_table
from ssdrbm.client import Client
from ssdrbm.errors import NotFound
from ssdrbm.sweeps import Range, Sweep, SweepRun, SweepState

# --option dest (the axis's short name) -> value type; each takes a comma list in `ssdrbm sweep`
SWEEPABLE = {
    "lr": float,
    "optimizer": str,
    "momentum": float,
    "seed": int,
    "cd_k": int,
    "n_hidden": int,
}
LOG_SCALE_AXES = ("lr",)  # ranges of step sizes are drawn log-uniformly
RANGE_SEPARATOR = ".."
FINAL_EXIT_CODES = {
    SweepState.SUCCEEDED: ExitCode.OK,
    SweepState.FAILED: ExitCode.JOB_FAILED,
    SweepState.CANCELLED: ExitCode.JOB_CANCELLED,
    SweepState.EXPIRED: ExitCode.OK,  # it ended; its jobs went by retention or were deleted
}
CLEAR_SCREEN = "\x1b[H\x1b[2J"


SWEEP = argument("sweep", metavar="SWEEP")
JSON_SWEEP = json_flag("print the sweep as JSON")


def register(commands: argparse._SubParsersAction, parents: list) -> None:
    add = functools.partial(add_command, commands, parents)
    sweep_help = "start many training jobs over a grid or random points, ranked live"
    sweep = add("sweep", sweep_help, run_sweep)
    _add_training_options(sweep)
    for action in sweep._actions:  # the sweepable options take comma lists here
        if action.dest in SWEEPABLE:
            action.type, action.choices = str, None
            action.help = f"{action.help or ''} — comma list to sweep".strip(" —")
    sweep.add_argument(
        "--per-parameter-lr-axis",
        action="append",
        default=[],
        metavar="NAME=LR,LR",
        help="sweep one parameter's step size, e.g. W=1e-3,1e-2 (repeatable)",
    )
    sweep.add_argument("--seeds", type=int, help="runs per point with seeds SEED, SEED+1, ...")
    sweep.add_argument("--random", type=int, metavar="N", help="N random points instead of a grid")
    sweep.add_argument("--sample-seed", type=int, help="seed of the random points [0]")
    sweep.add_argument(
        "--early-stop",
        metavar="MIN_STEPS[,ETA]",
        help="successive halving: rungs at MIN_STEPS·ETA^k, keep the best 1/ETA [ETA 3]",
    )
    sweep.add_argument(
        "--rank-by",
        metavar="METRIC",
        help="reconstruction_error [default], log_likelihood, pseudo_log_likelihood, "
        "free_energy_gap",
    )
    sweep.add_argument("--watch", action="store_true", help="show the leaderboard until it ends")
    sweep.add_argument("--dry-run", action="store_true", help="check every point, create nothing")
    sweep.add_argument("--json", action="store_true", help="print the sweep as JSON")
    listing = add("sweeps", "list sweeps, newest first", run_sweeps)
    add_listing_options(listing)
    watch = argument("--watch", action="store_true", help="follow it until it ends")
    show_help = "show a sweep's leaderboard"
    add("sweep-show", show_help, run_sweep_show, SWEEP, watch, json_flag("print it as JSON"))
    add("sweep-cancel", "cancel a sweep's runs", run_sweep_cancel, SWEEP, JSON_SWEEP)
    delete = add("sweep-delete", "delete a sweep and its runs' jobs", run_sweep_delete, SWEEP)
    delete.add_argument(
        "--force", action="store_true", help="cancel queued or running runs first, then delete"
    )
    delete.add_argument(
        "--keep-runs", action="store_true", help="delete only the sweep; keep its jobs"
    )


def _parse_values(flag: str, text: str, kind: type, random: bool) -> list[Any] | Range:
    if RANGE_SEPARATOR in text:
        if not random:
            raise UsageError(f"--{flag} {text}: ranges are for --random N; give a comma list")
        low, _, high = text.partition(RANGE_SEPARATOR)
        try:
            return Range(float(low), float(high), log=flag in LOG_SCALE_AXES)
        except ValueError:
            raise UsageError(f"--{flag} expects LOW..HIGH, got {text!r}") from None
    try:
        return [kind(item) for item in text.split(",") if item]
    except ValueError:
        raise UsageError(f"--{flag} expects a comma list of numbers, got {text!r}") from None


def sweep_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The :meth:`Client.start_sweep` arguments given on the command line."""
    random = args.random is not None
    axes: dict[str, Any] = {}
    for dest, kind in SWEEPABLE.items():
        text = getattr(args, dest)
        if text is None:
            continue
        values = _parse_values(dest.replace("_", "-"), text, kind, random)
        if isinstance(values, list) and len(values) == 1:
            setattr(args, dest, values[0])  # one value: the base every run shares
        else:
            setattr(args, dest, None)
            axes[dest] = values
    if args.optimizer is not None and args.optimizer not in spec.OPTIMIZERS:
        spec.choose("optimizer", args.optimizer, spec.OPTIMIZERS)  # names the choices
    for name, text in _pairs(args.per_parameter_lr_axis, "--per-parameter-lr-axis").items():
        axes[f"lr.{name}"] = _parse_values("per-parameter-lr-axis", text, float, random)
    kwargs = training_kwargs(args)  # its name is the sweep's (the runs are named after it)
    early: tuple[int, ...] | None = None
    if args.early_stop:
        try:
            early = tuple(int(part) for part in args.early_stop.split(","))
        except ValueError:
            raise UsageError(
                f"--early-stop expects MIN_STEPS[,ETA], got {args.early_stop!r}"
            ) from None
    plain = {name: getattr(args, name) for name in ("seeds", "random", "sample_seed", "rank_by")}
    return {**kwargs, **plain, "axes": axes, "early_stop": early}


def run_sweep(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm sweep``: print the sweep's id (or JSON); ``--watch`` shows its leaderboard."""
    return submit_and_follow(args, Client.start_sweep, sweep_kwargs(args), leaderboard, watch)


def watch(client: Client, sweep_id: str, *, as_json: bool) -> ExitCode:
    """Follow the leaderboard until the sweep ends: redrawn in place on a terminal, a summary
    line per update on stderr otherwise (then the final table), or JSON lines."""
    in_place = sys.stdout.isatty() and not as_json
    sweep = client.get_sweep(sweep_id)
    for sweep in client.stream_sweep(sweep_id):
        if as_json:
            print_json({"event": "sweep", "sweep": sweep}, lines=True)
        elif in_place:
            print(CLEAR_SCREEN + leaderboard(sweep), flush=True)
        else:
            print(summary(sweep), file=sys.stderr, flush=True)
    if not as_json and not in_place:
        print(leaderboard(sweep))
    return FINAL_EXIT_CODES.get(sweep.state, ExitCode.ERROR)


def summary(sweep: Sweep) -> str:
    """One line: the state, how many runs ended, and the best run so far."""
    ended = sum(run.state.terminal for run in sweep.runs)
    line = f"sweep {sweep.id} {sweep.state.value}: {ended}/{sweep.run_count} runs ended"
    if sweep.runs and sweep.runs[0].rank == 1:
        best = sweep.runs[0]
        line += f", best {best.job_id} {sweep.rank_metric} {format_number(best.rank_value)}"
    return line


def leaderboard(sweep: Sweep) -> str:
    """The runs, best first: rank, job, state, step, the rank metric, and the point."""
    axes = sorted({field for run in sweep.runs for field in run.point})
    headers = ["RANK", "JOB", "STATE", "STEP", (sweep.rank_metric or "metric").upper(), *axes]
    rows = [
        [
            str(run.rank or "-"),
            run.job_id or "-",
            _run_state(run),
            "-" if run.expired else f"{run.step}/{run.total_steps}",  # its job is gone
            format_number(run.rank_value),
            *(run.point.get(field, "-") for field in axes),
        ]
        for run in sweep.runs
    ]
    title = f"sweep {sweep.id or '(dry run: nothing was created)'} {sweep.name}".rstrip()
    rungs = f", early stopping at steps {sweep.rungs}" if sweep.rungs else ""
    state = f"{sweep.state.value}, {sweep.run_count} runs{rungs}"
    return f"{title} — {state}\n{render_table(headers, rows)}"


def run_sweeps(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm sweeps``: a table (or JSON list) of sweeps."""
    page_size = limited_page_size(args.limit)
    with client_from_args(args) as client:
        sweeps = list(itertools.islice(client.list_sweeps(page_size=page_size), args.limit or None))
    print_listing(sweeps, args.json, sweeps_table, "no sweeps yet — start one with 'ssdrbm sweep'")
    return ExitCode.OK


def sweeps_table(sweeps: list[Sweep]) -> str:
    """One row per sweep: id, name, state, runs, best job, creation time."""
    rows = [
        [
            sweep.id,
            sweep.name or "-",
            sweep.state.value,
            str(sweep.run_count),
            sweep.best_job_id or "-",
            format_time(sweep.created_at),
        ]
        for sweep in sweeps
    ]
    return render_table(("ID", "NAME", "STATE", "RUNS", "BEST JOB", "CREATED"), rows)


def run_sweep_show(args: argparse.Namespace) -> ExitCode:
    with client_from_args(args) as client:
        if args.watch:
            return watch(client, args.sweep, as_json=args.json)
        sweep = client.get_sweep(args.sweep)
    print_result(sweep, args.json, leaderboard)
    return ExitCode.OK


def run_sweep_cancel(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm sweep-cancel SWEEP``: the sweep after the request."""
    with client_from_args(args) as client:
        sweep = client.cancel_sweep(args.sweep)
    print_json(sweep) if args.json else print(f"{sweep.id} cancel requested ({sweep.state.value})")
    return ExitCode.OK


def run_sweep_delete(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm sweep-delete SWEEP [--force] [--keep-runs]``: prints what was deleted."""
    with client_from_args(args) as client:
        deleted = client.delete_sweep(args.sweep, force=args.force, keep_runs=args.keep_runs)
    kept = " (its jobs kept)" if args.keep_runs else f" with {deleted} jobs"
    print(f"{args.sweep} deleted{kept}")
    return ExitCode.OK


def _run_state(run: SweepRun) -> str:
    if run.expired:
        return "expired"
    return run.state.value if run.job_id else "-"


def find_sweep(client: Client, some_id: str) -> Sweep | None:
    """The sweep ``some_id`` names, None when it names none (it may be a job's id)."""
    try:
        return client.get_sweep(some_id)
    except NotFound:
        return None


def plot_sweep(client: Client, sweep: Sweep, output: Path) -> list[Path]:
    """One curve per run of the sweep's rank metric over steps, the best run highlighted."""
    from ssdrbm.cli import plot

    curves = []
    for run in sweep.runs:
        history = plot.metric_history(client, run.job_id)
        label = " ".join(f"{field}={value}" for field, value in run.point.items())
        curves.append(plot.SweepCurve(label, history, best=run.job_id == sweep.best_job_id))
    return [plot.write_sweep_figure(output, curves, sweep.rank_metric or "reconstruction_error")]
