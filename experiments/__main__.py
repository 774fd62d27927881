"""Command line: `python -m experiments NAME [--quick] [--out DIR] [--sequential] [--pilot]
[--time-only]`."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path

from experiments import common

EXPERIMENTS = (
    "tuning",
    "simulation",
    "mnist",
    "freyface",
    "beyond",
    "grbm",
    "transfer",
    "large",
    "convergence",
    "defaults",
    "schedules",
    "probe",
    "defaults_large",
)
# The experiments that pack compatible runs (experiments/packed.py) and take --sequential.
PACKED = ("tuning",)
# The experiments with a PILOT configuration (fewer seeds than the full run) that take --pilot.
PILOTED = ("large",)
# The experiments with a time budget that take --time-only (that budget alone).
TIMED = ("large",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    parser.add_argument("name", choices=EXPERIMENTS, help="which experiment to run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (tests)")
    parser.add_argument(
        "--out",
        type=Path,
        default=common.DEFAULT_OUT,
        help="root directory for figures and tables (default: docs/figures)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help=f"train every run alone instead of packing compatible runs ({', '.join(PACKED)})",
    )
    parser.add_argument(
        "--pilot",
        action="store_true",
        help=f"the smaller pilot configuration ({', '.join(PILOTED)})",
    )
    parser.add_argument(
        "--time-only",
        action="store_true",
        help=f"only the equal-time budget ({', '.join(TIMED)})",
    )
    arguments = parser.parse_args(argv)
    if arguments.sequential and arguments.name not in PACKED:
        parser.error(f"--sequential applies to {', '.join(PACKED)}; {arguments.name} runs alone")
    if arguments.pilot and arguments.name not in PILOTED:
        parser.error(f"--pilot applies to {', '.join(PILOTED)}; {arguments.name} has none")
    options = {"sequential": True} if arguments.sequential else {}
    if arguments.pilot:
        options["pilot"] = True
    if arguments.time_only:
        if arguments.name not in TIMED:
            parser.error(f"--time-only applies to {', '.join(TIMED)}; {arguments.name} has none")
        options["time_only"] = True
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    threads = common.configure_threads()
    module = importlib.import_module(f"experiments.{arguments.name}")
    started = time.perf_counter()
    summary = module.run(arguments.out, quick=arguments.quick, **options)
    summary["wall_seconds"] = time.perf_counter() - started
    summary["quick"] = arguments.quick
    summary["torch_threads"] = threads
    directory = common.output_dir(arguments.out, arguments.name)
    (directory / "run.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    logging.getLogger("experiments").info(
        "%s done in %.0f s; outputs in %s", arguments.name, summary["wall_seconds"], directory
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
