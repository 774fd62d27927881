"""Command line: `python -m experiments NAME [--quick] [--out DIR]`."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path

from experiments import common

EXPERIMENTS = ("tuning", "simulation", "mnist", "freyface", "beyond", "grbm")


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
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    threads = common.configure_threads()
    module = importlib.import_module(f"experiments.{arguments.name}")
    started = time.perf_counter()
    summary = module.run(arguments.out, quick=arguments.quick)
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
