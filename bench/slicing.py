"""Time slices' cost: throughput lost to preemption, and a waiting tenant's time to first step.

`python -m bench slicing [--quick]` (or `python -m bench.slicing --rounds N --slices 60,15,5`)
starts its own redis-server and the API alone (`bench.service_host`, SSDRBM_RUN_WORKER=0, two
tenants with bearer tokens), then runs the same fixed work once per slice setting, the settings
interleaved round after round (the order rotated each round), each on a fresh worker process
(`python -m ssdrbm_server.worker`, SSDRBM_WORKER_SLOTS=1, SSDRBM_SLICE_SECONDS set, one torch
thread):

1. alice submits a long job, and the worker starts;
2. once it has published its first metric step, bob submits a 10-step job, then a long job of
   his own (the same size as alice's);
3. the run ends when all three have SUCCEEDED.

"Off" is the same work with a slice longer than the run (nothing is ever preempted). From the
jobs' records and events (server timestamps), each run gives:

- ``cost_per_preemption_s``, measured directly for each preemption followed by a resume: on
  the worker's timeline, from the preempted job's last metric step before its release to the
  resumed job's first one after it, the time that was not training (the trainers' own
  ``wall_time_s``, steps only, interpolated to the stop and resume steps), less the ordinary
  gap between two metric steps of one job in the same run (an evaluation and its write). What
  is left is the preemption: the checkpoint, the release, the next claim and the resumed job's
  start (its trainer, checkpoint and first evaluation). Training speed, which drifts by 2x
  within minutes on a shared machine, is not in it;
- ``steps_per_s``: the steps over the worker's busy time, from alice's first metric step (the
  training process started and warm) to the last job's end; its ratio to "off" in the same
  round is the throughput kept, which the machine's drift dominates at long slices;
- ``overhead_per_preemption_s``: the run's non-training time over "off"'s, per preemption
  (a cross-check of the direct figure, with every evaluation's noise in it);
- ``release_to_claim_ms``: each preemption's release to the next job's claim (the queue's part);
- ``short_first_step_s``: bob's 10-step job, from its submit to its first metric step (its
  10th), with ``short_slice_left_s``, what was left of alice's job's slice at that submit, and
  ``short_beyond_slice_s``, the wait beyond it. Slices are counted from her claim; each new
  one starts at the first heartbeat (0.5 s) after the last one's end, so the figure is exact
  in her first slice (where the submit falls unless her start took longer than a slice) and
  drifts by up to a heartbeat per slice after it.

The target (at most 5% lost at the default slice) is judged on the loss that the
per-preemption cost implies when other work always waits: one preemption per slice costs
cost / (slice + cost) of the worker's time. The direct default-slice run is reported beside it;
it preempts once or twice in a run of minutes, so its ratio is within the machine's noise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from ssdrbm.connection import with_bearer_token
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from bench.data import REPO_ROOT
from bench.report import Case, Number, Target
from bench.service_process import redis_server, service_process, stop_process
from bench.timing import percentile
from ssdrbm_server.config import Settings

logger = logging.getLogger(__name__)

DEFAULT_SLICE_S = Settings().slice_seconds  # the service's default, owned by its Settings
OFF_S = 1e6  # a slice longer than any run: slicing off
TARGET_LOST = 0.05  # the goal: at most 5% of the throughput lost at the default slice
TOKENS = {"alice": "ta", "bob": "tb"}  # tenant -> bearer token
PREEMPTED = "preempted"  # how a preempted job's release message starts (worker/runner.py)
SHORT_STEPS = 10
POLL_S = 0.05
WORKER_STOP_S = 30.0


@dataclass(frozen=True)
class Plan:
    """The work of one run and the settings compared."""

    slices: tuple[float, ...]  # seconds; "off" is always added
    long_steps: int  # each tenant's long job
    rounds: int
    n_visible: int = 100
    n_hidden: int = 64
    batch: int = 100
    samples: int = 2000
    run_timeout_s: float = 900.0

    @classmethod
    def full(cls) -> Plan:
        # About 80 s per long job, evaluations included, on one core of the shared 2-core
        # machine: the default slice preempts alice's job once, the shorter ones many times.
        return cls(slices=(DEFAULT_SLICE_S, 15.0, 5.0), long_steps=25_000, rounds=3)

    @classmethod
    def quick(cls) -> Plan:
        # Slices of a heartbeat (0.5 s): jobs of a few seconds are preempted and resumed
        # several times even on a fast machine.
        return cls(slices=(0.5,), long_steps=3000, rounds=1, samples=500, run_timeout_s=120.0)

    @property
    def settings(self) -> tuple[float, ...]:
        return (OFF_S, *self.slices)


@dataclass(frozen=True)
class Run:
    """What one run's records and events say; the busy window starts at alice's first metric
    step, so that the training process's start (seconds on a loaded machine) is left out."""

    slice_s: float
    steps: int
    busy_s: float
    train_s: float
    preemptions: int
    preemption_costs_s: tuple[float, ...]  # each preempt-and-resume, measured (see below)
    release_to_claim_s: tuple[float, ...]
    short_first_step_s: float
    short_slice_left_s: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.busy_s

    @property
    def overhead_s(self) -> float:
        return self.busy_s - self.train_s


def label(slice_s: float) -> str:
    return "off" if slice_s >= OFF_S else f"slice {slice_s:g} s"


def job_request(plan: Plan, *, steps: int, seed: int, every: int = 0) -> pb.StartTrainingRequest:
    """A Bernoulli RBM on the synthetic data with the service's default SSD step size;
    ``every`` 0 takes the service's default evaluation and checkpoint spacing. Seeds differ
    between jobs, so no two pack together."""
    return pb.StartTrainingRequest(
        name=f"slicing-{seed}",
        model=pb.ModelSpec(kind=pb.MODEL_KIND_BERNOULLI, n_hidden=plan.n_hidden),
        optimizer=pb.OptimizerSpec(kind=pb.OPTIMIZER_KIND_SSD),
        training=pb.TrainingSpec(
            batch_size=plan.batch, steps=steps, seed=seed, checkpoint_every=every
        ),
        eval=pb.EvalSpec(every=every),
        dataset=pb.DatasetRef(
            builtin=pb.BuiltinDataset(
                name="synthetic",
                options={
                    "n_visible": str(plan.n_visible),
                    "n_hidden": "8",
                    "n_samples": str(plan.samples),
                },
            )
        ),
    )


def _seconds(timestamp: object) -> float:
    return timestamp.ToMicroseconds() / 1e6  # type: ignore[attr-defined]


def _events(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> list[pb.MetricEvent]:
    request = pb.StreamMetricsRequest(job_id=job_id, history_only=True)
    return list(stub.StreamMetrics(request, timeout=60))


def _state_events(events: list[pb.MetricEvent]) -> list[pb.MetricEvent]:
    return [e for e in events if e.WhichOneof("event") == "state"]


def _wait_until(stub: rbm_pb2_grpc.RBMServiceStub, job_ids: list[str], deadline: float, *,
                stepped: bool = False) -> list[pb.Job]:  # fmt: skip
    """Poll until every job has ended (``stepped``: has published a metric step); raise when
    one ended other than SUCCEEDED or the deadline passed."""
    while True:
        jobs = [stub.GetJob(pb.GetJobRequest(job_id=j), timeout=10) for j in job_ids]
        for job in jobs:
            if job.state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED):
                raise RuntimeError(f"job {job.id} ended {pb.JobState.Name(job.state)}: {job.error}")
        if all(job.step > 0 if stepped else job.state == pb.JOB_STATE_SUCCEEDED for job in jobs):
            return jobs
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs {job_ids} did not get there within the run's deadline")
        time.sleep(POLL_S if stepped else 10 * POLL_S)


def _worker_env(redis_url: str, slice_s: float, worker_id: str) -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("SSDRBM_")}
    return {
        **inherited,
        "SSDRBM_REDIS_URL": redis_url,
        "SSDRBM_WORKER_ID": worker_id,
        "SSDRBM_SLICE_SECONDS": str(slice_s),
        "SSDRBM_WORKER_SLOTS": "1",  # one training process: the jobs share it in time
        "SSDRBM_MAX_PACK_SIZE": "1",  # solo jobs (their seeds differ anyway)
        "SSDRBM_WORKER_METRICS_PORT": "0",
        "SSDRBM_TORCH_THREADS": "1",
        "SSDRBM_LOG_LEVEL": "WARNING",
    }


@contextmanager
def _worker(redis_url: str, slice_s: float, worker_id: str) -> Iterator[None]:
    worker = subprocess.Popen(
        [sys.executable, "-m", "ssdrbm_server.worker"],
        cwd=REPO_ROOT,
        env=_worker_env(redis_url, slice_s, worker_id),
    )
    try:
        yield
    finally:
        stop_process(worker, WORKER_STOP_S)


def one_run(
    alice: rbm_pb2_grpc.RBMServiceStub,
    bob: rbm_pb2_grpc.RBMServiceStub,
    redis_url: str,
    plan: Plan,
    slice_s: float,
    number: int,
) -> Run:
    """The run's work on a fresh worker with ``slice_s``; its figures from records and events."""
    seed = 10 * number
    long_a = alice.StartTraining(job_request(plan, steps=plan.long_steps, seed=seed + 1)).job.id
    deadline = time.monotonic() + plan.run_timeout_s
    with _worker(redis_url, slice_s, f"slicing-{number}"):
        _wait_until(alice, [long_a], deadline, stepped=True)
        short = bob.StartTraining(
            job_request(plan, steps=SHORT_STEPS, seed=seed + 2, every=SHORT_STEPS)
        ).job.id
        long_b = bob.StartTraining(job_request(plan, steps=plan.long_steps, seed=seed + 3)).job.id
        jobs = _wait_until(alice, [long_a], deadline) + _wait_until(bob, [short, long_b], deadline)
    events = {
        long_a: _events(alice, long_a),
        short: _events(bob, short),
        long_b: _events(bob, long_b),
    }
    return figures(slice_s, jobs, events)


@dataclass(frozen=True)
class Point:
    """A metric event: when it was written, the job's step and its training time so far (the
    trainer's ``wall_time_s``: steps only, carried across a resume by the checkpoint)."""

    time: float
    step: int
    trained_s: float


def _points(events: list[pb.MetricEvent]) -> list[Point]:
    return [
        Point(_seconds(e.time), e.metrics.step, e.metrics.wall_time_s)
        for e in events
        if e.WhichOneof("event") == "metrics"
    ]


def trained_at(points: list[Point], step: int) -> float:
    """The job's training time at ``step``, interpolated between its metric steps (training
    time per step is even between two of them: a preemption adds none)."""
    before = max((p for p in points if p.step <= step), key=lambda p: p.step, default=None)
    after = min((p for p in points if p.step >= step), key=lambda p: p.step)
    if before is None:
        before = Point(0.0, 0, 0.0)
    if after.step == before.step:
        return before.trained_s
    share = (step - before.step) / (after.step - before.step)
    return before.trained_s + share * (after.trained_s - before.trained_s)


def evaluation_gap(points: dict[str, list[Point]], state_times: list[float]) -> float:
    """The median time between two metric steps of one job that is not training (its
    evaluation, the event's write, now and then a checkpoint), over the pairs with no state
    change between them."""
    gaps = [
        (b.time - a.time) - (b.trained_s - a.trained_s)
        for job_points in points.values()
        for a, b in itertools.pairwise(job_points)
        if not any(a.time < t < b.time for t in state_times)
    ]
    return statistics.median(gaps)


def preemption_costs(
    points: dict[str, list[Point]], states: list[tuple[float, str, pb.StateChange]]
) -> list[float]:
    """Each preemption followed by a resume, measured on the worker's timeline: from the
    preempted job's last metric step before its release to the resumed job's first one after,
    the time that is not training (their steps in between, interpolated), less one ordinary
    gap between metric steps: its checkpoint, release, the next claim, and the resumed job's
    start (trainer, checkpoint, first evaluation). A preemption for a job's first start (bob's
    jobs) is left out: that start costs the same without slicing."""
    ordinary = evaluation_gap(points, [t for t, _, _ in states])
    costs = []
    for index, (released, job, change) in enumerate(states):
        if not change.message.startswith(PREEMPTED):
            continue
        claimed = next(
            ((j, c) for _, j, c in states[index + 1 :] if c.state == pb.JOB_STATE_RUNNING), None
        )
        if claimed is None or claimed[1].step == 0:
            continue
        resumed, resume_step = claimed[0], claimed[1].step
        last = max((p for p in points[job] if p.time < released), key=lambda p: p.time)
        first = min((p for p in points[resumed] if p.time > released), key=lambda p: p.time)
        if sum(last.time < t < first.time for t, _, _ in states) != 2:
            continue  # another claim or release in between (a slice shorter than an evaluation)
        training = (trained_at(points[job], change.step) - last.trained_s) + (
            first.trained_s - trained_at(points[resumed], resume_step)
        )
        costs.append(first.time - last.time - training - ordinary)
    return costs


def slice_left(slice_s: float, claimed: float, submitted: float) -> float:
    """What was left of the running job's slice at ``submitted``; it took the worker at
    ``claimed`` and nothing waited before (each slice ended in a new one); 0 with slicing off."""
    if slice_s >= OFF_S:
        return 0.0
    return slice_s - (submitted - claimed) % slice_s


def figures(slice_s: float, jobs: list[pb.Job], events: dict[str, list[pb.MetricEvent]]) -> Run:
    """A run's figures; ``jobs``: alice's long job, bob's short one, bob's long one."""
    long_a, short, _ = jobs
    points = {job_id: _points(job_events) for job_id, job_events in events.items()}
    states = sorted(
        (_seconds(e.time), job_id, e.state)
        for job_id, job_events in events.items()
        for e in _state_events(job_events)
    )
    start = points[long_a.id][0]  # alice's first metric step: the worker is warm
    ended = max(_seconds(job.finished_at) for job in jobs)
    released = [t for t, _, s in states if s.message.startswith(PREEMPTED)]
    claims = [t for t, _, s in states if s.state == pb.JOB_STATE_RUNNING]
    hops = tuple(min((c for c in claims if c >= t), default=ended) - t for t in released)
    submitted = _seconds(short.created_at)
    return Run(
        slice_s=slice_s,
        steps=sum(job.total_steps for job in jobs) - start.step,
        busy_s=ended - start.time,
        train_s=sum(job.latest_metrics.wall_time_s for job in jobs) - start.trained_s,
        preemptions=len(released),
        preemption_costs_s=tuple(preemption_costs(points, states)),
        release_to_claim_s=hops,
        short_first_step_s=points[short.id][0].time - submitted,
        short_slice_left_s=slice_left(slice_s, claims[0], submitted),
    )


def measure(plan: Plan) -> dict[float, list[Run]]:
    """Every setting once per round on the API-only service, the order rotated each round;
    the runs by setting."""
    tenants = ",".join(f"{token}={tenant}" for tenant, token in TOKENS.items())
    env = {"SSDRBM_RUN_WORKER": "0", "SSDRBM_AUTH_MODE": "token", "SSDRBM_AUTH_TOKENS": tenants}
    with (
        tempfile.TemporaryDirectory(prefix="ssdrbm-bench-slicing-") as scratch,
        redis_server(Path(scratch)) as redis_url,
        service_process(redis_url, Path(scratch), env) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        alice = rbm_pb2_grpc.RBMServiceStub(with_bearer_token(channel, TOKENS["alice"]))
        bob = rbm_pb2_grpc.RBMServiceStub(with_bearer_token(channel, TOKENS["bob"]))
        return _rounds(alice, bob, redis_url, plan)


def _rounds(
    alice: rbm_pb2_grpc.RBMServiceStub,
    bob: rbm_pb2_grpc.RBMServiceStub,
    redis_url: str,
    plan: Plan,
) -> dict[float, list[Run]]:
    settings = list(plan.settings)
    runs: dict[float, list[Run]] = {s: [] for s in settings}
    number = 0
    for round_index in range(plan.rounds):
        shift = round_index % len(settings)
        for slice_s in settings[shift:] + settings[:shift]:
            number += 1
            run = one_run(alice, bob, redis_url, plan, slice_s, number)
            runs[slice_s].append(run)
            logger.info(
                "slicing round %d, %s: %.1f steps/s, %d preemptions, median cost %s s, "
                "short job's first step after %.2f s (slice left %.2f s)",
                round_index + 1,
                label(slice_s),
                run.steps_per_s,
                run.preemptions,
                _median(list(run.preemption_costs_s)),
                run.short_first_step_s,
                run.short_slice_left_s,
            )
    return runs


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def extra_overhead_per_preemption(runs: list[Run], off: list[Run]) -> list[float]:
    """Per round: the run's non-training time over "off"'s, per preemption (a cross-check of
    the direct measure, with every evaluation's load noise in it)."""
    return [
        (run.overhead_s - base.overhead_s) / run.preemptions
        for run, base in zip(runs, off, strict=True)
        if run.preemptions
    ]


def implied_loss(cost_s: float, slice_s: float) -> float:
    """The share of a worker's time lost when every slice ends in a preemption."""
    return cost_s / (slice_s + cost_s)


def _costs(runs: list[Run]) -> list[float]:
    return [cost for run in runs for cost in run.preemption_costs_s]


def _case(plan: Plan, slice_s: float, runs: list[Run], off: list[Run]) -> Case:
    kept = [r.steps_per_s / o.steps_per_s for r, o in zip(runs, off, strict=True)]
    costs = _costs(runs)
    cost = _median(costs)
    hops = [h for run in runs for h in run.release_to_claim_s]
    metrics: dict[str, Number] = {
        "steps_per_s": _median([r.steps_per_s for r in runs]),
        "busy_s": _median([r.busy_s for r in runs]),
        "preemptions": _median([float(r.preemptions) for r in runs]),
        "cost_per_preemption_s": cost,
        "cost_p90_s": None if not costs else percentile(costs, 0.9),
        "overhead_per_preemption_s": _median(extra_overhead_per_preemption(runs, off)),
        "release_to_claim_ms": None if not hops else 1000 * statistics.median(hops),
        "short_first_step_s": _median([r.short_first_step_s for r in runs]),
        "short_slice_left_s": _median([r.short_slice_left_s for r in runs]),
        "short_beyond_slice_s": None
        if slice_s >= OFF_S
        else _median([r.short_first_step_s - r.short_slice_left_s for r in runs]),
    }
    ratios: dict[str, Number] = {}
    if slice_s < OFF_S:
        ratios = {"throughput_vs_off": _median(kept)}
        if cost is not None:
            ratios["implied_lost"] = implied_loss(cost, slice_s)
    config = {
        "slice_s": "off" if slice_s >= OFF_S else slice_s,
        "work": f"2 x {plan.long_steps} + {SHORT_STEPS} steps",
        "model": f"{plan.n_visible}x{plan.n_hidden} SSD batch {plan.batch}",
        "rounds": len(runs),
    }
    return Case("slicing", label(slice_s), config, metrics, ratios)


def _target(plan: Plan, runs: dict[float, list[Run]], quick: bool) -> Target:
    """The default slice's loss implied by the cost of every preemption measured."""
    costs = [cost for slice_s in plan.slices for cost in _costs(runs[slice_s])]
    measured: float | None = None
    why = "quick run: too few preemptions to judge"
    if not quick and costs:
        measured = implied_loss(statistics.median(costs), DEFAULT_SLICE_S)
        why = (
            f"median cost of the {len(costs)} preemptions measured, over the default slice "
            f"({DEFAULT_SLICE_S:g} s) plus it: other work always waiting"
        )
    return Target(
        "slicing",
        f"throughput lost at the default slice ({DEFAULT_SLICE_S:g} s)",
        measured,
        TARGET_LOST,
        "<=",
        "",
        why,
    )


def run(*, quick: bool = False, plan: Plan | None = None) -> tuple[list[Case], list[Target]]:
    plan = plan or (Plan.quick() if quick else Plan.full())
    runs = measure(plan)
    off = runs[OFF_S]
    cases = [_case(plan, slice_s, runs[slice_s], off) for slice_s in plan.settings]
    return cases, [_target(plan, runs, quick)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slicing", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--slices", help="comma-separated seconds, e.g. 60,15,5")
    parser.add_argument("--steps", type=int, help="each long job's steps")
    parser.add_argument("--visible", type=int, help="the model's visible units (default 100)")
    parser.add_argument("--hidden", type=int, help="the model's hidden units (default 64)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    plan = Plan.quick() if args.quick else Plan.full()
    if args.rounds:
        plan = replace(plan, rounds=args.rounds)
    if args.slices:
        plan = replace(plan, slices=tuple(float(s) for s in args.slices.split(",")))
    if args.steps:
        plan = replace(plan, long_steps=args.steps)
    if args.visible:
        plan = replace(plan, n_visible=args.visible)
    if args.hidden:
        plan = replace(plan, n_hidden=args.hidden)
    cases, targets = run(quick=args.quick, plan=plan)
    for record in [*cases, *targets]:
        print(json.dumps(record.as_json()) if args.json else record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
