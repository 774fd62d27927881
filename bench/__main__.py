"""Command line: `python -m bench [SUITE|all] [--json] [--quick] [--only TEXT]`.

Suites: core, sklearn, service, pack, service-pack; slicing (on its own, not in `all`: it
runs for half an hour).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

from bench.report import Case, Report, Target, read_json_lines, write
from bench.timing import environment, set_threads

logger = logging.getLogger("bench")

Suite = Callable[..., tuple[list[Case], list[Target]]]
ON_ITS_OWN = ("slicing",)  # suites that `all` leaves out (too long for the run of record)


def _suites() -> dict[str, Suite]:
    # Imported lazily so that `--help` does not load torch, scikit-learn or the server.
    def core(quick: bool):
        from bench import core

        return core.run(quick=quick)

    def sklearn(quick: bool):
        from bench import sklearn_case

        return sklearn_case.run(quick=quick)

    def service(quick: bool):
        from bench import service

        return service.run(quick=quick)

    def pack(quick: bool, only: str | None = None):
        from bench import pack

        return pack.run(quick=quick, only=only)

    def service_pack(quick: bool):
        from bench import service_pack

        return service_pack.run(quick=quick)

    def slicing(quick: bool):
        from bench import slicing

        return slicing.run(quick=quick)

    return {
        "core": core,
        "sklearn": sklearn,
        "service": service,
        "pack": pack,
        "service-pack": service_pack,
        "slicing": slicing,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure ssdrbm's speed; ratios measured in one run are the figures of record.",
    )
    parser.add_argument(
        "suite",
        nargs="?",
        default="all",
        choices=["core", "sklearn", "service", "pack", "service-pack", "slicing", "all"],
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads for every implementation (default: each library's own default)",
    )
    parser.add_argument(
        "--only",
        metavar="TEXT",
        help="pack suite only: measure the configurations whose label contains TEXT "
        "(e.g. grbm: the Gaussian packs)",
    )
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        help="print the tables of a saved run (from --save-json) instead of measuring",
    )
    parser.add_argument(
        "--save-json", metavar="PATH", help="also write the JSON lines to PATH (with the table)"
    )
    return parser.parse_args(argv)


def run(suite: str, *, quick: bool, only: str | None = None) -> tuple[Report, list[str]]:
    """Run one suite or all of them; return the report and the suites that failed. ``only``
    (pack suite only) filters its configurations by label."""
    suites = _suites()
    names = [name for name in suites if name not in ON_ITS_OWN] if suite == "all" else [suite]
    report = Report(environment={**environment(), "quick": quick, "suites": names})
    if only is not None:
        report.environment["only"] = only
    failed = []
    for name in names:
        started = time.perf_counter()
        try:
            cases, targets = suites[name](quick, only) if only else suites[name](quick)
        except Exception:
            logger.exception("suite %s failed", name)
            failed.append(name)
            continue
        report.extend(cases, targets)
        logger.info("suite %s took %.1f s", name, time.perf_counter() - started)
    report.environment["failed_suites"] = failed
    return report, failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if args.from_json:
        with open(args.from_json) as saved:
            write(read_json_lines(saved), sys.stdout, as_json=args.json)
        return 0
    if args.only is not None and args.suite != "pack":
        print(
            "python -m bench: --only filters the pack suite; run `pack --only TEXT`",
            file=sys.stderr,
        )
        return 2
    if args.threads is not None:
        if args.threads < 1:
            print("python -m bench: --threads must be at least 1", file=sys.stderr)
            return 2
        set_threads(args.threads)
    report, failed = run(args.suite, quick=args.quick, only=args.only)
    write(report, sys.stdout, as_json=args.json)
    if args.save_json:
        with open(args.save_json, "w") as saved:
            write(report, saved, as_json=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
