"""A job's progress as its events tell it: the one ETA rule of ``ssdrbm watch`` and the
service's dashboard, and how a duration is shown."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ssdrbm.events import BackoffEvent, JobState, MetricEvent, MetricsEvent, QueuePlace, StateEvent


@dataclass
class ProgressState:
    """What is known about a job from the events seen so far."""

    job_id: str
    state: JobState = JobState.QUEUED
    step: int = 0
    total_steps: int = 0
    samples_per_second: float | None = None
    wall_time_s: float | None = None
    reconstruction_error: float | None = None
    log_likelihood: float | None = None
    message: str = ""
    queue: QueuePlace | None = None  # the latest place read while QUEUED

    def update(self, event: MetricEvent) -> None:
        """Fold one stream event into the state."""
        if isinstance(event, MetricsEvent):
            metrics = event.metrics
            self.step = metrics.step
            self.total_steps = metrics.total_steps or self.total_steps
            self.samples_per_second = metrics.samples_per_second
            self.wall_time_s = metrics.wall_time_s
            self.reconstruction_error = metrics.reconstruction_error
            if metrics.log_likelihood is not None:
                self.log_likelihood = metrics.log_likelihood
        elif isinstance(event, StateEvent):
            self.state = event.state
            if event.state is not JobState.QUEUED:
                self.queue = None
            self.step = max(self.step, event.step)
            self.message = event.message
        elif isinstance(event, BackoffEvent):
            self.step = event.rollback_step  # training goes back; the bar follows it

    @property
    def fraction(self) -> float:
        """Share of the steps done, in [0, 1]."""
        if self.total_steps <= 0:
            return 0.0
        return min(max(self.step / self.total_steps, 0.0), 1.0)

    def eta_s(self) -> float | None:
        """Seconds left at the average pace so far; None before the first timed step."""
        if self.total_steps and self.step >= self.total_steps:
            return 0.0
        if not self.wall_time_s or self.step <= 0 or not self.total_steps:
            return None
        return (self.total_steps - self.step) * self.wall_time_s / self.step


def format_duration(seconds: float | None) -> str:
    """``h:mm:ss`` or ``m:ss``; "-" when unknown."""
    if seconds is None or not 0 <= seconds < math.inf:  # NaN fails the comparison too
        return "-"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
