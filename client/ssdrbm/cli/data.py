"""Commands about data: ``upload``, ``datasets``, ``delete-dataset``."""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ssdrbm.cli.context import add_command, argument, client_from_args, json_flag
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.output import format_time, print_json, print_listing, print_result
from ssdrbm.cli.tables import render_table
from ssdrbm.client import Client
from ssdrbm.datasets import Dataset
from ssdrbm.errors import SSDRBMError

T = TypeVar("T")


def register(commands: argparse._SubParsersAction, parents: list) -> None:
    add = functools.partial(add_command, commands, parents)
    upload = add("upload", "upload a .npy array and print its dataset id", run_upload)
    upload.add_argument("file", metavar="FILE", help=".npy of shape (N, features) or (N, H, W)")
    upload.add_argument("--name", default="", help="label stored with the dataset")
    upload.add_argument("--json", action="store_true", help="print id, shape and size as JSON")
    as_json = json_flag("print them as a JSON list")
    add("datasets", "list your uploaded datasets", run_datasets, as_json)
    delete_help = "delete an uploaded dataset (refused while a queued or running job uses it)"
    dataset = argument("dataset", metavar="ID", help="dataset id from 'ssdrbm upload'")
    add("delete-dataset", delete_help, run_delete_dataset, dataset)


def run_upload(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm upload FILE``: the dataset id to pass to ``train --dataset-id``."""
    with client_from_args(args) as client:
        dataset = client.upload_dataset_details(args.file, name=args.name)
    print_result(dataset, args.json, lambda dataset: dataset.id)
    return ExitCode.OK


def run_datasets(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm datasets``: a table (or JSON list) of the caller's datasets."""
    with client_from_args(args) as client:
        datasets = list(client.list_datasets())
    empty = "no datasets yet — upload one with 'ssdrbm upload FILE'"
    print_listing(datasets, args.json, datasets_table, empty)
    return ExitCode.OK


def datasets_table(datasets: list[Dataset]) -> str:
    """One row per dataset: id, name, shape, dtype, size, upload time."""
    rows = [
        [
            dataset.id,
            dataset.name or "-",
            "x".join(str(n) for n in dataset.shape),
            dataset.dtype,
            str(dataset.size_bytes),
            format_time(dataset.created_at),
        ]
        for dataset in datasets
    ]
    return render_table(("ID", "NAME", "SHAPE", "DTYPE", "BYTES", "CREATED"), rows)


def run_delete_dataset(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm delete-dataset ID``: removes it from your datasets; prints what was deleted."""
    with client_from_args(args) as client:
        client.delete_dataset(args.dataset)
    print(f"{args.dataset} deleted")
    return ExitCode.OK


def submit_with_data(
    client: Client,
    data: str | None,
    submit: Callable[..., T],
    kwargs: dict[str, Any],
    *,
    dry_run: bool,
) -> T:
    """``submit(validate_only=dry_run, **kwargs)``, training on the ``.npy`` file ``data`` (its
    upload's id as ``dataset_id``) when one is given (``train --data``, ``sweep --data``).

    A dataset this upload created is deleted again when the submit is a dry run or is refused,
    so that neither leaves a dataset behind; one the caller had already is left alone.
    """
    if data is None:
        return submit(validate_only=dry_run, **kwargs)
    uploaded = client.upload_dataset_details(data)
    submitted = False
    try:
        result = submit(validate_only=dry_run, **{**kwargs, "dataset_id": uploaded.id})
        submitted = not dry_run
        return result
    finally:
        if uploaded.created and not submitted:
            # Best effort: the submit's own error (or the dry run's result) is what to report.
            # A submit that did create a job despite its error keeps the dataset: the service
            # refuses to delete one that a queued job trains on.
            with contextlib.suppress(SSDRBMError):
                client.delete_dataset(uploaded.id)


def submit_and_follow(
    args: argparse.Namespace,
    submit: Callable[..., Any],
    kwargs: dict[str, Any],
    preview: Callable[[Any], str],
    follow: Callable[..., ExitCode],
) -> ExitCode:
    """``train`` and ``sweep``: ``submit(client, **kwargs)`` with ``--data``
    (:func:`submit_with_data`); a dry run prints its ``preview`` (or JSON), otherwise the new
    id is printed (a JSON line under ``--json``) and ``--watch`` then follows it to its end
    (``follow(client, id, as_json=...)``)."""
    with client_from_args(args) as client:
        start = functools.partial(submit, client)
        submitted = submit_with_data(client, args.data, start, kwargs, dry_run=args.dry_run)
        if args.dry_run:
            print_result(submitted, args.json, preview)
            return ExitCode.OK
        if args.json:
            print_json(submitted, lines=args.watch)
        else:
            print(submitted.id, flush=True)
        if not args.watch:
            return ExitCode.OK
        return follow(client, submitted.id, as_json=args.json)
