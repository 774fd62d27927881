"""Plain-text tables aligned on column widths (no dependencies; pipes and terminals alike)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ssdrbm.cli.output import format_number, format_time
from ssdrbm.events import Job
from ssdrbm.spec import TrainingDefaults


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, separated by two spaces; no trailing blanks."""
    widths = [len(header) for header in headers]
    for row in rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]
    lines = []
    for row in [list(headers), *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


JOB_HEADERS = ("ID", "NAME", "STATE", "STEP", "RECON", "LOG-LIK", "CREATED")
QUEUE_HEADER = "QUEUE"  # only when a listed job is queued: its place and expected start


def job_row(job: Job) -> list[str]:
    """One row of the ``ssdrbm jobs`` table."""
    metrics = job.latest_metrics
    return [
        job.id,
        job.name or "-",
        job.state.value,
        f"{job.step}/{job.total_steps}",
        format_number(metrics.reconstruction_error if metrics else None),
        format_number(metrics.log_likelihood if metrics else None),
        format_time(job.created_at),
    ]


def jobs_table(jobs: Sequence[Job]) -> str:
    """The ``ssdrbm jobs`` table (with a QUEUE column when one of them is queued)."""
    rows = [job_row(job) for job in jobs]
    if not any(job.queue is not None for job in jobs):
        return render_table(JOB_HEADERS, rows)
    places = [job.queue.summary() if job.queue is not None else "-" for job in jobs]
    rows = [[*row, place] for row, place in zip(rows, places, strict=True)]
    return render_table((*JOB_HEADERS, QUEUE_HEADER), rows)


def flatten_spec(spec: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """A job's resolved spec as (dotted field, value) pairs; its values are rendered already
    (enum names as the options take them: ssdrbm.spec.message_dict)."""
    pairs: list[tuple[str, str]] = []
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("options", "per_parameter", "per_parameter_lr"):
            pairs += flatten_spec(value, f"{name}.")
        else:
            pairs.append((name, str(value)))
    return pairs


def job_details(job: Job) -> str:
    """``key: value`` lines describing one job, for ``ssdrbm get``."""
    metrics = job.latest_metrics
    fields = [
        ("id", job.id or "- (dry run: nothing was created)"),
        ("name", job.name or "-"),
        ("state", job.state.value if job.id else "-"),
        ("step", f"{job.step}/{job.total_steps}"),
        ("checkpoint step", str(job.checkpoint_step) if job.checkpoint_step >= 0 else "none"),
        ("attempt", str(job.attempt)),
        ("worker", job.worker or "-"),
        ("n_visible", str(job.n_visible or "-")),
        ("created", job.created_at.isoformat() if job.created_at else "-"),
        ("started", job.started_at.isoformat() if job.started_at else "-"),
        ("finished", job.finished_at.isoformat() if job.finished_at else "-"),
    ]
    if job.queue is not None:
        fields += [("queue", job.queue.summary()), ("queue estimate", job.queue.basis)]
    if metrics is not None:
        fields += [
            ("reconstruction error", format_number(metrics.reconstruction_error)),
            ("log-likelihood", format_number(metrics.log_likelihood)),
            ("spectral norm", format_number(metrics.spectral_norm)),
            ("samples/s", format_number(metrics.samples_per_second)),
        ]
        if metrics.pt_swap_rates:  # parallel tempering: one rate per neighbour pair
            rates = " ".join(format_number(rate) for rate in metrics.pt_swap_rates)
            fields.append(("swap rates", rates))
    if job.runtime:
        fields.append(("runtime", job.runtime))
    if job.backoffs:
        fields.append(("backoffs", str(job.backoffs)))
    if job.training_process_failures:
        fields.append(("training process failures", str(job.training_process_failures)))
    if job.error:
        fields.append(("error", job.error))
    fields += [(f"spec.{key}", value) for key, value in flatten_spec(job.spec)]
    width = max(len(key) for key, _ in fields)
    return "\n".join(f"{key + ':':<{width + 1}} {value}" for key, value in fields)


def defaults_table(defaults: TrainingDefaults) -> str:
    """The server's default step sizes as a table, then every other default as spec lines."""
    rows = [
        (
            entry.model,
            entry.variance or "-",
            entry.optimizer,
            entry.step_rule or "-",
            f"{entry.lr_for(short_run=True):g}",
            f"{entry.lr_for(short_run=False):g}",
        )
        for entry in defaults.step_sizes
    ]
    short, long = defaults.short_run_steps, defaults.long_run_steps
    headers = ("model", "variance", "optimizer", "step rule", f"<= {short} steps", f">= {long}")
    table = render_table(headers, rows)
    lines = [
        "default step sizes (--lr), by the job's length:",
        *("  " + line for line in table.splitlines()),
        f"  (between {short} and {long} steps: the geometric interpolation, to two digits;",
        "  'ssdrbm train ... --dry-run' shows a job's own)",
    ]
    lines.append("other defaults (a request giving only --hidden 16, as the server resolves it):")
    pairs = [(key, value) for key, value in flatten_spec(defaults.example) if key != "request_id"]
    width = max(len(key) for key, _ in pairs)
    lines += [f"  {key + ':':<{width + 1}} {value}" for key, value in pairs]
    return "\n".join(lines)
