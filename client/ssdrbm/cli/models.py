"""Commands that use a trained model: ``reconstruct``, ``features``, ``export``, ``plot``."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ssdrbm.cli import sweeps
from ssdrbm.cli.context import add_command, client_from_args
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.funnel import UsageError
from ssdrbm.cli.jobs import JOB, JOB_HELP
from ssdrbm.cli.names import job_id
from ssdrbm.cli.output import print_json, print_result
from ssdrbm.client import Client
from ssdrbm.datasets import load_array
from ssdrbm.export import FORMATS


def register(commands: argparse._SubParsersAction, parents: list) -> None:
    add = functools.partial(add_command, commands, parents)
    reconstruct = add("reconstruct", "reconstruct inputs through a trained model", run_reconstruct)
    _add_io(reconstruct, "reconstructions")
    reconstruct.add_argument("-k", type=int, default=1, help="Gibbs steps")
    reconstruct.add_argument("--mean-field", action="store_true", help="means, not samples")

    features = add("features", "hidden-unit features of inputs", run_features)
    _add_io(features, "features (N, n_hidden)")
    features.add_argument("--sample", action="store_true", help="0/1 samples, not probabilities")

    export_help = "write model.safetensors and config.json, an ONNX file or a Triton model folder"
    export = add("export", export_help, run_export, JOB)
    export.add_argument(
        "--output", "-o", required=True, metavar="PATH", help="a folder; a file for --format onnx"
    )
    export.add_argument(
        "--format",
        choices=list(FORMATS),
        default="safetensors",
        help="onnx: one .onnx file; triton: PATH/<model-name>/config.pbtxt and 1/model.onnx",
    )
    export.add_argument("--model-name", help="the Triton model name (default: the job id)")
    export.add_argument("--checkpoint-step", type=int, default=0, help="0 = latest")
    export.add_argument("--json", action="store_true", help="print the written paths as JSON")

    plot_help = "PNG figures of a job and its model, or of a sweep's runs"
    plot = add("plot", plot_help, run_plot)
    plot.add_argument("job", metavar="JOB|SWEEP", help=f"{JOB_HELP}, or a sweep id")
    plot.add_argument("--output", "-o", required=True, metavar="DIR")
    plot.add_argument("--input", "-i", metavar="X.npy", help="inputs shown beside reconstructions")
    plot.add_argument("--image-shape", metavar="HxW", help="e.g. 28x28 (guessed when missing)")
    plot.add_argument("--json", action="store_true", help="print the written files as JSON")


def _add_io(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("job", metavar="JOB", help=JOB_HELP)
    parser.add_argument("--input", "-i", required=True, metavar="X.npy", help="(N, n_visible)")
    parser.add_argument("--output", "-o", required=True, metavar="Y.npy", help=f"where {what} go")
    parser.add_argument("--seed", type=int, default=0, help="0 = random")
    parser.add_argument("--checkpoint-step", type=int, default=0, help="0 = latest")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")


def _serve(args: argparse.Namespace, call: Callable[..., np.ndarray], **options: Any) -> ExitCode:
    """Run a serving ``call`` of the client (``Client.reconstruct``, ``Client.sample_hidden``)
    on the ``--input`` array with the shared ``--seed`` and ``--checkpoint-step``, and save its
    result to ``--output``."""
    x = load_array(args.input)
    with client_from_args(args) as client:
        args.job = job_id(client, args.job)
        result = call(
            client, args.job, x, seed=args.seed, checkpoint_step=args.checkpoint_step, **options
        )
    np.save(args.output, result)
    summary = {"job_id": args.job, "output": args.output, "shape": list(result.shape)}
    print_result(summary, args.json, lambda _: f"{args.output} {tuple(result.shape)}")
    return ExitCode.OK


def run_reconstruct(args: argparse.Namespace) -> ExitCode:
    return _serve(args, Client.reconstruct, k=args.k, mean_field=args.mean_field)


def run_features(args: argparse.Namespace) -> ExitCode:
    return _serve(args, Client.sample_hidden, mode="sample" if args.sample else "probs")


def run_export(args: argparse.Namespace) -> ExitCode:
    with client_from_args(args) as client:
        args.job = job_id(client, args.job)
        written = client.export_model(
            args.job,
            args.output,
            checkpoint_step=args.checkpoint_step,
            format=args.format,
            model_name=args.model_name,
        )
    written = Path(written)
    if written.is_dir():
        directory, files = written, sorted((p for p in written.rglob("*") if p.is_file()), key=str)
    else:
        directory, files = written.parent, [written]
    subject = {"job_id": args.job, "format": args.format, "directory": str(directory)}
    return _print_written(args, subject, files)


def parse_image_shape(text: str | None) -> tuple[int, int] | None:
    """``"28x20"`` → (28, 20)."""
    if text is None:
        return None
    height, sep, width = text.lower().partition("x")
    if not sep or not height.isdigit() or not width.isdigit():
        raise UsageError(f"--image-shape expects HxW such as 28x28, got {text!r}")
    return int(height), int(width)


def run_plot(args: argparse.Namespace) -> ExitCode:
    """``ssdrbm plot JOB --output DIR``: metric curves, filters, W histogram, and more."""
    from ssdrbm.cli import plot  # matplotlib is imported only for this command

    plot.require_matplotlib()  # before anything is fetched: say at once what to install
    image_shape = parse_image_shape(args.image_shape)
    inputs = load_array(args.input) if args.input else None
    with client_from_args(args) as client:  # a sweep's id: one curve per run
        sweep = sweeps.find_sweep(client, args.job)
        if sweep is not None:
            written = sweeps.plot_sweep(client, sweep, Path(args.output))
            return _print_written(args, {"sweep_id": sweep.id}, written)
        args.job = job_id(client, args.job)
        history = plot.metric_history(client, args.job)
        model = client.fetch_model(args.job)
        reconstructions = None
        if inputs is not None:
            inputs = inputs[: plot.MAX_EXAMPLES]
            reconstructions = client.reconstruct(args.job, inputs, mean_field=True, seed=1)
    written = plot.write_figures(
        Path(args.output),
        history=history,
        model=model,
        inputs=inputs,
        reconstructions=reconstructions,
        image_shape=image_shape,
    )
    return _print_written(args, {"job_id": args.job}, written)


def _print_written(
    args: argparse.Namespace, subject: dict[str, str], written: list[Path]
) -> ExitCode:
    if args.json:
        print_json({**subject, "files": [str(path) for path in written]})
    else:
        print("\n".join(str(path) for path in written))
    return ExitCode.OK
