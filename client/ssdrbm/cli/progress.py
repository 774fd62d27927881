"""Live progress of a training job on stderr (or, under ``--json``, as JSON lines on stdout).

On a terminal a single line is redrawn in place (step/total, a bar, samples/s, ETA, the latest
reconstruction error and log-likelihood; while the job is queued, its place in the queue);
anywhere else each event becomes one plain log line, so logs stay readable. Both end with a
one-line summary.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from ssdrbm.cli.output import format_number, format_rate, print_json
from ssdrbm.events import (
    FINISHED_MESSAGE,
    BackoffEvent,
    Job,
    JobState,
    MetricEvent,
    MetricsEvent,
    QueuePlace,
    StateEvent,
    to_jsonable,
)
from ssdrbm.progress import ProgressState, format_duration

REDRAW_INTERVAL_S = 0.1  # redrawing faster than this only costs terminal bandwidth
BAR_WIDTH = 20


def render_line(progress: ProgressState, width: int = 100) -> str:
    """The one-line TTY display, fitted to ``width`` columns (the bar shrinks first)."""
    if progress.state is JobState.QUEUED and progress.queue is not None:
        line = f"queued: {progress.queue.summary()}"
        return line if len(line) <= width else line[: max(width - 1, 0)] + "…"
    head = f"{progress.state.value} step {progress.step}/{progress.total_steps or '?'}"
    tail = [
        f"{progress.fraction:4.0%}",
        f"{format_rate(progress.samples_per_second)} samples/s",
        f"ETA {format_duration(progress.eta_s())}",
        f"recon {format_number(progress.reconstruction_error)}",
    ]
    if progress.log_likelihood is not None:
        tail.append(f"LL {format_number(progress.log_likelihood)}")
    line = f"{head}  {'  '.join(tail)}"
    if len(line) + BAR_WIDTH + 4 <= width:  # the bar only where it fits
        filled = round(progress.fraction * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)  # e.g. #####-----
        line = f"{head}  [{bar}]  {'  '.join(tail)}"
    return line if len(line) <= width else line[: max(width - 1, 0)] + "…"


def render_log_line(progress: ProgressState, event: MetricEvent) -> str:
    """The plain (non-TTY) line for one event."""
    if isinstance(event, StateEvent):
        detail = f": {event.message}" if event.message else ""
        return f"{progress.job_id} {event.state.value} at step {event.step}{detail}"
    if isinstance(event, BackoffEvent):
        return render_backoff(progress.job_id, event)
    fields = [
        f"step={progress.step}/{progress.total_steps or '?'}",
        f"recon={format_number(progress.reconstruction_error)}",
    ]
    if event.metrics.log_likelihood is not None:
        fields.append(f"ll={format_number(event.metrics.log_likelihood)}")
    if event.metrics.pt_swap_rate_min is not None:  # parallel tempering: its weakest pair
        fields.append(f"swap_min={format_number(event.metrics.pt_swap_rate_min)}")
    fields.append(f"samples/s={format_rate(progress.samples_per_second)}")
    fields.append(f"eta={format_duration(progress.eta_s())}")
    return f"{progress.job_id} " + " ".join(fields)


def render_backoff(job_id: str, event: BackoffEvent) -> str:
    """A blow-up and the rollback that answered it, on a line of its own."""
    return (
        f"{job_id} blew up at step {event.step} ({event.reason}); backoff "
        f"{event.backoff}/{event.max_backoffs}: back to step {event.rollback_step}, lr "
        f"{event.old_lr:g} → {event.new_lr:g}"
    )


def render_summary(job: Job) -> str:
    """The closing line: final state, steps, time and metrics (or the failure's reason)."""
    metrics = job.latest_metrics
    elapsed = None
    if job.started_at and job.finished_at:
        elapsed = (job.finished_at - job.started_at).total_seconds()
    elif metrics is not None:
        elapsed = metrics.wall_time_s
    line = f"job {job.id} {job.state.value} at step {job.step}/{job.total_steps}"
    line += f" in {format_duration(elapsed)}"
    if metrics is not None:
        line += f" — recon {format_number(metrics.reconstruction_error)}"
        if metrics.log_likelihood is not None:
            line += f", LL {format_number(metrics.log_likelihood)}"
    if job.backoffs:
        line += f" — {job.backoffs} backoff{'s' if job.backoffs > 1 else ''}"
    if job.error:
        line += f" — {job.error}"
    return line


class _Follower:
    """What both ways of showing a followed job share: its state so far, and the lock that keeps
    apart the lines of the event stream and of QueueWatch (another thread). Each shows a queue
    reading (``_show_queue``), an event (``_show_event``) and the job at its end (``_show_end``)
    in its own way."""

    def __init__(self, job_id: str) -> None:
        self.progress = ProgressState(job_id)
        self._lock = threading.Lock()

    def start(self, job: Job) -> None:
        """Begin from the job's record (state, step and total before any event arrives)."""
        self.progress.state = job.state
        self.progress.step = job.step
        self.progress.total_steps = job.total_steps
        if job.queue is not None:
            self.on_queue(job.queue)

    @property
    def queued(self) -> bool:
        """The job is QUEUED as far as its events tell."""
        return self.progress.state is JobState.QUEUED

    def on_queue(self, place: QueuePlace) -> None:
        """A new reading of the job's place (ignored once it started meanwhile)."""
        with self._lock:
            if self.queued:
                before, self.progress.queue = self.progress.queue, place
                self._show_queue(place, before is None or queue_changed(before, place))

    def on_event(self, event: MetricEvent) -> None:
        """Update with one event and show it."""
        with self._lock:
            self.progress.update(event)
            self._show_event(event)

    def finish(self, job: Job) -> None:
        """Show the job as it ended."""
        with self._lock:
            self._show_end(job)


class ProgressDisplay(_Follower):
    """Draws a job's progress on ``stream`` (stderr by default) as its events arrive, and its
    place in the queue as QueueWatch reads it."""

    def __init__(self, job_id: str, stream: TextIO | None = None, tty: bool | None = None):
        super().__init__(job_id)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._last_draw = 0.0
        self._drawn = False

    def _show_queue(self, place: QueuePlace, changed: bool) -> None:
        # Redrawn on a terminal; in logs, a line only when the position or the reason for no
        # estimate changed (not one per reading).
        if self.tty:
            self._draw()
        elif changed:
            print(f"{self.progress.job_id} queued: {place.summary()}", file=self.stream, flush=True)

    def _show_event(self, event: MetricEvent) -> None:
        if self.tty and isinstance(event, BackoffEvent):  # worth a line of its own
            self.stream.write("\r\x1b[2K" + render_backoff(self.progress.job_id, event) + "\n")
        if not self.tty:
            print(render_log_line(self.progress, event), file=self.stream, flush=True)
            return
        now = time.monotonic()
        if now - self._last_draw >= REDRAW_INTERVAL_S or isinstance(event, StateEvent):
            self._draw()
            self._last_draw = now

    def _draw(self) -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write("\r\x1b[2K" + render_line(self.progress, width))
        self.stream.flush()
        self._drawn = True

    def _show_end(self, job: Job) -> None:
        # The one-line summary replaces the live line; on a terminal, where the state events
        # were not printed, a finished run's note (a drift) follows it.
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
        print(render_summary(job), file=self.stream, flush=True)
        note = self.progress.message
        if self.tty and job.state is JobState.SUCCEEDED and note not in ("", FINISHED_MESSAGE):
            print(f"note: {note}", file=self.stream, flush=True)


def queue_changed(before: QueuePlace, after: QueuePlace) -> bool:
    """Worth a new log line: the position moved, or an estimate came or went."""
    return (before.position, before.no_worker, before.starts_in_s is None) != (
        after.position,
        after.no_worker,
        after.starts_in_s is None,
    )


class JsonLines(_Follower):
    """``--watch --json``: one JSON line per event on stdout, a ``queue`` line when a queued
    job's place changes, and the job at the end."""

    def _show_queue(self, place: QueuePlace, changed: bool) -> None:
        if changed:
            queue = {"event": "queue", "job_id": self.progress.job_id, "queue": place}
            print_json(queue, lines=True)

    def _show_event(self, event: MetricEvent) -> None:
        print_json({"event": event_kind(event), **to_jsonable(event)}, lines=True)

    def _show_end(self, job: Job) -> None:
        print_json({"event": "job", "job": job}, lines=True)


def event_kind(event: MetricEvent) -> str:
    """The ``event`` field of a JSON line: metrics, state or backoff."""
    if isinstance(event, MetricsEvent):
        return "metrics"
    return "backoff" if isinstance(event, BackoffEvent) else "state"


QUEUE_POLL_S = 2.0  # how often a watch asks a queued job's place (a GetJob, a few Redis reads)


class QueueWatch:
    """While a watched job is queued, reads its place every QUEUE_POLL_S in a thread of its own
    (the metric stream says nothing while the job waits) and hands it to ``report``."""

    def __init__(
        self,
        get_job: Callable[[], Job],
        queued: Callable[[], bool],
        report: Callable[[QueuePlace], None],
    ) -> None:
        self._get_job, self._queued, self._report = get_job, queued, report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="queue-watch", daemon=True)

    def __enter__(self) -> QueueWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=QUEUE_POLL_S + 5)

    def _run(self) -> None:
        while not self._stop.wait(QUEUE_POLL_S):
            if not self._queued():
                continue
            try:
                place = self._get_job().queue
            except Exception:  # the stream reports lasting trouble; a missed reading is harmless
                continue
            if place is not None and not self._stop.is_set():
                self._report(place)
