"""Prometheus metrics of a worker, updated from what it already handles: the training process's
``progress`` messages (each run of steps and its time), its claims and its fenced writes. A
worker inside the server process registers them in the server's registry (one /metrics); a
worker-only process serves its own on SSDRBM_WORKER_METRICS_PORT. Labels stay few: the model
kind and the optimizer (never a job id or tenant).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.store.records import TERMINAL_STATES
from ssdrbm_server.vocabulary import MODEL_NAMES, OPTIMIZER_NAMES

JOB_LABELS = ("model", "optimizer")
# 0.1 ms (a tiny model on a GPU) to 10 s (a large model with a full-matrix step on a CPU): 1, 2.5
# and 5 of each power of ten (equal, as floats, to the literals 0.0001, 0.00025, ...).
STEP_BUCKETS = (*(m * 10.0**e for e in range(-4, 1) for m in (1, 2.5, 5)), 10.0)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600)
CHECKPOINT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def job_labels(spec: rbm_pb2.StartTrainingRequest) -> dict[str, str]:
    """The label values of a job's training series, from its resolved spec."""
    return {
        "model": MODEL_NAMES.get(spec.model.kind, "unknown"),
        "optimizer": OPTIMIZER_NAMES.get(spec.optimizer.kind, "unknown"),
    }


class WorkerMetrics:
    """A worker's collectors, in ``registry`` (a new one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # every collector registers in this worker's registry
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        self.samples = counter(
            "ssdrbm_training_samples",
            "Training examples processed (steps × batch size); rate() gives samples per second",
            JOB_LABELS,
        )
        self.step_seconds = histogram(
            "ssdrbm_training_step_seconds",
            "Time of one training step (each run of steps between polls, divided evenly)",
            JOB_LABELS,
            buckets=STEP_BUCKETS,
        )
        self.queue_wait = histogram(
            "ssdrbm_queue_wait_seconds",
            "From a job's submit to its first claim by a worker",
            buckets=QUEUE_WAIT_BUCKETS,
        )
        self.lease_takeovers = counter(
            "ssdrbm_lease_takeovers", "Running jobs taken over after their worker's lease lapsed"
        )
        self.checkpoint_write = histogram(
            "ssdrbm_checkpoint_write_seconds",
            "Time to store one checkpoint in Redis (the fenced write, retries included)",
            buckets=CHECKPOINT_BUCKETS,
        )
        self.jobs_finished = counter(
            "ssdrbm_worker_jobs_finished", "Jobs a worker ended, by final state", ["state"]
        )
        self.process_failures = counter(
            "ssdrbm_training_process_failures",
            "Training processes that died or hung during a job (each one a retry of the job)",
        )
        self.preemptions = counter(
            "ssdrbm_preemptions",
            "Jobs checkpointed and put back in the queue at their time slice's end because "
            "other work waited (SSDRBM_SLICE_SECONDS)",
        )
        self.backoffs = counter(
            "ssdrbm_training_backoffs",
            "Blow-ups rolled back to the last good state, training going on with smaller steps",
        )
        # Summed over a process's workers (one, normally) and, by Prometheus, over processes:
        # busy ÷ slots is how much of the training capacity is in use.
        self.slots = gauge(
            "ssdrbm_worker_slots",
            "Slots of the running workers: jobs or packs they can train at once "
            "(SSDRBM_WORKER_SLOTS)",
        )
        self.busy_slots = gauge("ssdrbm_worker_busy_slots", "Slots training a job or pack now")
        for state in TERMINAL_STATES:  # every state's series exists from the first scrape on
            self.jobs_finished.labels(state=state.value)

    def trained(
        self, labels: dict[str, str], runs: Iterable[Sequence[float]], batch_size: int
    ) -> None:
        """Count runs of training steps: each ``(steps, seconds)``."""
        samples = self.samples.labels(**labels)
        step_seconds = self.step_seconds.labels(**labels)
        for steps, seconds in runs:
            count = int(steps)
            if count <= 0:
                continue
            samples.inc(count * batch_size)
            per_step = float(seconds) / count
            for _ in range(count):
                step_seconds.observe(per_step)
