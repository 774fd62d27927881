"""Packed training through the service: a simulation step-size sweep, packed against one job at
a time, on one worker, in one run.

`python -m bench service-pack [--quick]` (or `python -m bench.service_pack`) starts its own
redis-server and an API-only service (`bench.service_host`, SSDRBM_RUN_WORKER=0), submits the
sweep's jobs (the paper's simulation model: 100×16 Bernoulli RBM, CD-1, batch 100, SGD, step
sizes spread over a factor of 2, one seed so one data tensor serves every run), and only then
starts one worker process (`python -m ssdrbm_server.worker`), so that every job is queued when
it looks. The figure is the wall time from the worker's start to the last job SUCCEEDED, with
SSDRBM_MAX_PACK_SIZE=32 (the jobs train as one pack) and =1 (one job after another, today's
behaviour), each on a fresh worker once the queue is empty again; the ratio of the two is the
figure of record, with the service's default evaluation and checkpoint spacing. The sweep runs
again evaluated and checkpointed only at its last step, which shows what training alone gains
(every evaluation of a 100×16 job computes its exact log-likelihood, run by run, packed or not).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from bench.data import REPO_ROOT
from bench.report import Case, Target
from bench.service import wait_for_job
from bench.service_process import redis_server, service_process, stop_process

logger = logging.getLogger(__name__)

N_VISIBLE, N_HIDDEN, BATCH, CD_K = 100, 16, 100, 1
BASE_LR = 0.01  # SGD; the runs' step sizes spread from it to twice it, as a sweep's would
TARGET_X = 8.0  # the goal: the packed sweep completes at least this much sooner
WORKER_STOP_S = 30.0


@dataclass(frozen=True)
class Plan:
    """The sweep: how many jobs, how long each trains and on how many examples."""

    jobs: int
    steps: int
    samples: int

    @classmethod
    def full(cls) -> Plan:
        return cls(jobs=32, steps=1000, samples=5000)

    @classmethod
    def quick(cls) -> Plan:
        return cls(jobs=4, steps=40, samples=500)


@dataclass(frozen=True)
class Outcome:
    """One mode's sweep: its wall time and what the jobs' runtimes say about packing."""

    wall_s: float
    packed_jobs: int  # jobs whose runtime summary says they trained packed
    largest_pack: int


def request(index: int, plan: Plan, *, at_end_only: bool) -> pb.StartTrainingRequest:
    """Point ``index`` of the sweep: its step size; everything else shared. ``at_end_only``:
    evaluated and checkpointed at the last step only (else the service's defaults)."""
    lr = BASE_LR * (1 + index / max(1, plan.jobs - 1))
    sparse = plan.steps if at_end_only else 0  # 0: the server's default
    return pb.StartTrainingRequest(
        name=f"sweep-{index}",
        model=pb.ModelSpec(kind=pb.MODEL_KIND_BERNOULLI, n_hidden=N_HIDDEN),
        optimizer=pb.OptimizerSpec(kind=pb.OPTIMIZER_KIND_SGD, lr=lr),
        training=pb.TrainingSpec(
            batch_size=BATCH, cd_k=CD_K, steps=plan.steps, seed=0, checkpoint_every=sparse
        ),
        eval=pb.EvalSpec(every=sparse),
        dataset=pb.DatasetRef(
            builtin=pb.BuiltinDataset(
                name="synthetic",
                options={
                    "n_visible": str(N_VISIBLE),
                    "n_hidden": str(N_HIDDEN),
                    "n_samples": str(plan.samples),
                },
            )
        ),
    )


def _worker_env(redis_url: str, pack_size: int) -> dict[str, str]:
    return {
        **os.environ,
        "SSDRBM_REDIS_URL": redis_url,
        "SSDRBM_MAX_PACK_SIZE": str(pack_size),
        "SSDRBM_WORKER_METRICS_PORT": "0",
        "SSDRBM_TORCH_THREADS": "1",  # both modes on one core each, the same for both
        "SSDRBM_WORKER_SLOTS": "1",  # one training process: packed against one at a time
        "SSDRBM_LOG_LEVEL": "WARNING",
    }


def sweep(
    stub: rbm_pb2_grpc.RBMServiceStub,
    redis_url: str,
    plan: Plan,
    pack_size: int,
    *,
    at_end_only: bool,
) -> Outcome:
    """Queue the sweep on the API-only service, then time one fresh worker training all of
    it (the queue is empty when this starts: the previous sweep has ended)."""
    job_ids = [
        stub.StartTraining(request(i, plan, at_end_only=at_end_only)).job.id
        for i in range(plan.jobs)
    ]
    started = time.perf_counter()
    worker = subprocess.Popen(
        [sys.executable, "-m", "ssdrbm_server.worker"],
        cwd=REPO_ROOT,
        env=_worker_env(redis_url, pack_size),
    )
    try:
        jobs = [wait_for_job(stub, job_id) for job_id in job_ids]
        wall = time.perf_counter() - started
    finally:
        stop_process(worker, WORKER_STOP_S)
    sizes = [_pack_size(job.runtime.summary) for job in jobs]
    return Outcome(wall, sum(1 for s in sizes if s > 1), max(sizes))


def _pack_size(summary: str) -> int:
    """N of "packed with N runs" in a job's runtime summary; 1 for a job trained alone."""
    marker = "packed with "
    if marker not in summary:
        return 1
    return int(summary.split(marker, 1)[1].split()[0])


def run(*, quick: bool = False) -> tuple[list[Case], list[Target]]:
    """Both modes in one run (the sweep evaluated at its end only too, in full runs); one case
    per mode, the ratio on the packed one, and the target (on the default spacing)."""
    plan = Plan.quick() if quick else Plan.full()
    spacings = [False] if quick else [False, True]
    cases: list[Case] = []
    ratios: dict[bool, float] = {}
    with tempfile.TemporaryDirectory(prefix="ssdrbm-bench-pack-") as scratch:
        directory = Path(scratch)
        with (
            redis_server(directory) as redis_url,
            service_process(redis_url, directory, {"SSDRBM_RUN_WORKER": "0"}) as server,
            grpc.insecure_channel(server.target) as channel,
        ):
            stub = rbm_pb2_grpc.RBMServiceStub(channel)
            for at_end_only in spacings:
                outcomes = {}
                for label, size in (("packed", plan.jobs), ("one at a time", 1)):
                    outcomes[label] = sweep(stub, redis_url, plan, size, at_end_only=at_end_only)
                    logger.info("service pack: %s took %.1f s", label, outcomes[label].wall_s)
                ratios[at_end_only] = outcomes["one at a time"].wall_s / outcomes["packed"].wall_s
                cases += _cases(plan, outcomes, ratios[at_end_only], at_end_only=at_end_only)
    ratio = ratios[False]
    target = Target(
        "service-pack",
        f"simulation sweep of {plan.jobs} jobs: packed x sooner than one at a time",
        None if quick else ratio,
        TARGET_X,
        ">=",
        "x",
        "quick run: too few jobs to judge"
        if quick
        else "every evaluation (exact log-likelihood and pseudo-likelihood of each run) costs "
        "what it costs alone, and the packed step is 3-4x a solo step (docs/PERFORMANCE.md)",
    )
    return cases, [target]


def _cases(
    plan: Plan, outcomes: dict[str, Outcome], ratio: float, *, at_end_only: bool
) -> list[Case]:
    spacing = "evaluated at the end" if at_end_only else "default evaluation spacing"
    config = {
        "jobs": plan.jobs,
        "steps": plan.steps,
        "model": f"{N_VISIBLE}x{N_HIDDEN} CD-{CD_K} batch {BATCH} SGD",
        "samples": plan.samples,
        "evaluation": spacing,
    }
    return [
        Case(
            "service-pack",
            f"simulation sweep of {plan.jobs}, {spacing}/{label}",
            {**config, "max_pack_size": plan.jobs if label == "packed" else 1},
            {
                "wall_s": outcome.wall_s,
                "jobs_per_s": plan.jobs / outcome.wall_s,
                "packed_jobs": outcome.packed_jobs,
                "largest_pack": outcome.largest_pack,
            },
            {"packed_x_sooner": ratio} if label == "packed" else {},
        )
        for label, outcome in outcomes.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service_pack", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    cases, targets = run(quick=args.quick)
    for record in [*cases, *targets]:
        print(json.dumps(record.as_json()) if args.json else record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
