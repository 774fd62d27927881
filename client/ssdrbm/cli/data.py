"""Commands about data: ``upload``."""

from __future__ import annotations

import argparse

from ssdrbm.cli.context import client_from_args
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.output import print_json


def register(commands: argparse._SubParsersAction, parents: list) -> None:
    """Add the data commands to the ``ssdrbm`` parser."""
    upload = commands.add_parser(
        "upload", parents=parents, help="upload a .npy array and print its dataset id"
    )
    upload.add_argument("file", metavar="FILE", help=".npy of shape (N, features) or (N, H, W)")
    upload.add_argument("--name", default="", help="label stored with the dataset")
    upload.add_argument("--json", action="store_true", help="print id, shape and size as JSON")
    upload.set_defaults(run=run_upload)


def run_upload(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm upload FILE``: the dataset id to pass to ``train --dataset-id``."""
    with client_from_args(args) as client:
        dataset = client.upload_dataset_details(args.file, name=args.name)
    if args.json:
        print_json(dataset)
    else:
        print(dataset.id)
    return ExitCode.OK
