"""`python -m bench.profile_core [--hidden H] [--k K] [--optimizer NAME] [--model M] [--steps N]`

Where the time of one training iteration goes: runs the project's Trainer under torch.profiler
and prints the operators by self CPU time, plus the share of the step spent in the random draws,
the matrix products, the spectral step and everything else (Python and per-op overhead).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.core import PROJECT_OPTIMIZERS, Variant, build_project, load_datasets, pick_device
from bench.core import Plan as CorePlan


def profile_step(model: str, optimizer: str, n_hidden: int, cd_k: int, steps: int):
    """Profile `steps` iterations after a warm-up; returns (profiler, seconds per iteration)."""
    device = pick_device()
    plan = CorePlan.quick()
    datasets = load_datasets(plan, device)
    run = build_project(
        Variant("project", model, optimizer), datasets[model], n_hidden=n_hidden, cd_k=cd_k
    )
    run(5)
    start = time.perf_counter()
    run(steps)
    seconds = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("train_steps"):
        run(steps)
    return prof, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_core")
    parser.add_argument("--model", default="bernoulli", choices=["bernoulli", "gaussian"])
    parser.add_argument("--optimizer", default="ssd-lowrank", choices=list(PROJECT_OPTIMIZERS))
    parser.add_argument("--hidden", type=int, default=500)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prof, seconds = profile_step(args.model, args.optimizer, args.hidden, args.k, args.steps)
    print(
        f"{args.model} {args.optimizer} 784x{args.hidden} CD-{args.k}: "
        f"{1000 * seconds:.2f} ms per iteration unprofiled, torch threads "
        f"{torch.get_num_threads()}"
    )
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    total = sum(e.self_cpu_time_total for e in averages if e.key != "train_steps")
    wall = next(e.cpu_time_total for e in averages if e.key == "train_steps")
    print(f"operators' self time: {total / 1000:.1f} ms of {wall / 1000:.1f} ms profiled wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
