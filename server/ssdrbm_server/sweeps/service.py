"""The sweep RPCs: StartSweep, GetSweep, ListSweeps, CancelSweep, StreamSweep, DeleteSweep.

StartSweep checks everything before it creates anything: every size from the request's own
numbers (request_bounds.check_sweep), the axes and their points, each point resolved by the one
resolver in a thread (a bad point is INVALID_ARGUMENT naming the axis and its value), the rank
metric against what the runs report, and the tenant's job limit. Then the sweep record, then one
ordinary job per point, tagged with the sweep's id (store.py has the order and its repair).

DeleteSweep deletes each run's job as DeleteJob does (`force` alike), then the sweep's keys;
with `keep_runs` the jobs lose their sweep tag and stay. A run whose job is gone shows as
`expired`; a sweep whose runs are all gone is EXPIRED, and with finished_job_ttl_seconds its
record goes too (`expire_if_done`, driven by expiry.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server import convert, request_bounds, resolver
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    tenant_subject,
)
from ssdrbm_server.rank_metrics import metric_value, resolve_rank_metric, signed_value
from ssdrbm_server.request_checks import check_text, enum_value
from ssdrbm_server.store.connection import cancellable
from ssdrbm_server.store.datasets import DatasetInfo
from ssdrbm_server.store.jobs import JobStore
from ssdrbm_server.store.records import JobState
from ssdrbm_server.sweeps import axes as sweep_axes
from ssdrbm_server.sweeps.ranking import check_reported
from ssdrbm_server.sweeps.rungs import eval_every_for, resolve_rungs
from ssdrbm_server.sweeps.store import SweepRecord, SweepStore

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often a StreamSweep call reads its runs
HEARTBEAT_S = 2.0  # an update at least this often, changed or not
_RUN_FIELDS = ["state", "step", "total_steps", "latest_metrics", "error"]


# What expire_if_done found (sweeps/expiry.py acts on it).
GONE, ACTIVE, WAITING, EXPIRED = "gone", "active", "waiting", "expired"


class SweepService:
    """The sweep operations of one API process, over the job and sweep stores."""

    def __init__(self, settings: Settings, jobs: JobStore, sweeps: SweepStore) -> None:
        self.settings = settings
        self.jobs = jobs
        self.sweeps = sweeps

    async def start(
        self, request: pb.StartSweepRequest, tenant: str, find_upload: resolver.UploadLookup
    ) -> pb.Sweep:
        resolved, points, jobs = await self._resolve(request, find_upload)
        point_text = [
            {field: sweep_axes.format_value(field, value) for field, value in point.items()}
            for point in points
        ]
        if request.validate_only:
            return _unsubmitted(resolved, point_text, jobs)
        sweep_id, new = await self.sweeps.reserve_id(
            tenant, request.request_id, self.settings.idempotency_ttl_seconds
        )
        done = 0
        existing = None
        if not new:  # the sweep of an earlier StartSweep with this request_id, unless it died first
            with contextlib.suppress(NotFoundError):
                existing = await self.sweeps.get(tenant, sweep_id)
        if existing is not None:  # a repeat: the same request finishes what the first began
            first = pb.StartSweepRequest.FromString(existing.request)
            resolver.check_same_request(first, resolved, f"sweep {existing.id}")
            if existing.cancel_requested:
                return await self.get(tenant, sweep_id)
            done = len(existing.job_ids)
        await self._check_quota(tenant, len(jobs) - done)
        await self.sweeps.create(
            tenant,
            sweep_id,
            name=resolved.name,
            request=resolved.SerializeToString(),
            points=point_text,
            rungs=list(resolved.early_stopping.rungs),
            eta=resolved.early_stopping.reduction_factor,
            rank_metric=resolved.rank_metric,
        )
        for index in range(done, len(jobs)):
            await self._submit_run(tenant, sweep_id, resolved, index, jobs[index], points[index])
        logger.info("sweep %s: %d runs for tenant %s", sweep_id, len(jobs), tenant)
        try:
            return await self.get(tenant, sweep_id)
        except NotFoundError:
            raise _deleted_while_created(sweep_id) from None  # its delete removed every run

    async def _resolve(
        self, request: pb.StartSweepRequest, find_upload: resolver.UploadLookup
    ) -> tuple[pb.StartSweepRequest, list[sweep_axes.Point], list[resolver.ResolvedJob]]:
        """The resolved request (rank metric and rungs filled in), its points and their jobs;
        nothing is written."""
        check_text(request.name, "name", self.settings.max_string_length)
        check_text(request.request_id, "request_id", resolver.MAX_REQUEST_ID_LENGTH)
        enum_value(pb.SweepMode, request.mode, "mode")
        if request.base.request_id:
            raise InvalidArgumentError(
                "base.request_id", "leave it empty; the sweep's request_id covers its runs"
            )
        request_bounds.check_sweep(request, self.settings)  # every size, before any is walked
        metric = resolve_rank_metric(request.rank_metric)
        axes = sweep_axes.check_axes(request)
        points = sweep_axes.expand(axes, request)
        try:  # no axis changes the dataset: the runs share one lookup
            upload = await resolver.find_dataset(request.base, self.settings, find_upload)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"base.{error.field}", error.description) from None
        # Resolving every point (and asking which metrics its model reports) is CPU work that
        # grows with the points: a thread's, so the event loop keeps answering other calls.
        return await asyncio.to_thread(self._resolve_points, request, metric, axes, points, upload)

    def _resolve_points(
        self,
        request: pb.StartSweepRequest,
        metric: str,
        axes: list[sweep_axes.Axis],
        points: list[sweep_axes.Point],
        upload: DatasetInfo | None,
    ) -> tuple[pb.StartSweepRequest, list[sweep_axes.Point], list[resolver.ResolvedJob]]:
        # The runs' step count (the rungs need it) does not depend on any axis: the first point
        # tells it.
        first = self._resolve_point(request.base, axes, points[0], 0, upload)
        rungs, eta = resolve_rungs(request.early_stopping, first.total_steps)
        base = pb.StartTrainingRequest()
        base.CopyFrom(request.base)
        base.validate_only = False
        base.eval.every = eval_every_for(base.eval.every, self.settings.default_eval_every, rungs)
        jobs = [
            self._resolve_point(base, axes, point, index, upload)
            for index, point in enumerate(points)
        ]
        check_reported(
            metric,
            [job.spec for job in jobs],
            [_where(index, point) for index, point in enumerate(points)],
        )
        resolved = pb.StartSweepRequest()
        resolved.CopyFrom(request)
        resolved.base.CopyFrom(base)
        resolved.validate_only = False
        resolved.rank_metric = metric
        resolved.early_stopping.min_steps = 0  # expanded into the rungs
        resolved.early_stopping.rungs[:] = rungs
        resolved.early_stopping.reduction_factor = eta
        return resolved, points, jobs

    def _resolve_point(
        self,
        base: pb.StartTrainingRequest,
        axes: list[sweep_axes.Axis],
        point: sweep_axes.Point,
        index: int,
        upload: DatasetInfo | None,
    ) -> resolver.ResolvedJob:
        spec = sweep_axes.apply_point(base, point)
        try:
            return resolver.resolve_known(spec, self.settings, upload)
        except InvalidArgumentError as error:
            raise _point_error(error, axes, point, index) from None

    async def _check_quota(self, tenant: str, new_jobs: int) -> None:
        limit = self.settings.max_jobs_per_tenant
        active = await self.jobs.count_active(tenant)
        if new_jobs > 0 and active + new_jobs > limit:
            raise ResourceExhaustedError(
                f"the sweep needs {new_jobs} jobs, but the tenant has {active} queued or running "
                f"of its {limit} (max_jobs_per_tenant); use fewer points, or wait for jobs to "
                "finish or cancel some",
                limit="max_jobs_per_tenant",
                subject=tenant_subject(tenant),
            )

    async def _submit_run(
        self,
        tenant: str,
        sweep_id: str,
        sweep: pb.StartSweepRequest,
        index: int,
        job: resolver.ResolvedJob,
        point: sweep_axes.Point,
    ) -> None:
        label = sweep.name or f"sweep {sweep_id[:8]}"
        name = f"{label} #{index}: {sweep_axes.describe(point)}"[: self.settings.max_string_length]
        try:
            record, _ = await self.jobs.submit(
                tenant,
                job.spec.SerializeToString(),
                name=name,
                total_steps=job.total_steps,
                n_visible=job.n_visible,
                request_id=f"sweep-{sweep_id}-{index}",
                max_active=self.settings.max_jobs_per_tenant,
                max_records=self.settings.max_job_records_per_tenant,
                idempotency_ttl_s=self.settings.idempotency_ttl_seconds,
                sweep_id=sweep_id,
                pack_key=job.pack_key,  # a sweep's points train together where they can
            )
        except ResourceExhaustedError as error:
            # Another submit took the room checked above: the sweep is cancelled as a whole.
            await self.sweeps.mark(tenant, sweep_id, cancel=True, error=error.message)
            await self._cancel_runs(tenant, await self.sweeps.get(tenant, sweep_id))
            raise
        if not await self.sweeps.add_run(tenant, sweep_id, index, record.id):
            await self.jobs.delete(tenant, record.id, force=True)  # queued: cancelled and gone
            raise _deleted_while_created(sweep_id)

    async def get(self, tenant: str, sweep_id: str) -> pb.Sweep:
        """The sweep with its runs ranked by its rank metric, best first."""
        return await self._to_proto(await self.sweeps.get(tenant, sweep_id))

    async def list(self, tenant: str, *, page_size: int, page_token: str) -> pb.ListSweepsResponse:
        records, next_token = await self.sweeps.list(
            tenant, page_size=page_size, page_token=page_token
        )
        response = pb.ListSweepsResponse(next_page_token=next_token)
        for record in records:
            sweep = await self._to_proto(record)
            del sweep.runs[:]  # GetSweep has them
            response.sweeps.append(sweep)
        return response

    async def cancel(self, tenant: str, sweep_id: str) -> pb.Sweep:
        """Cancel every queued run at once and ask running ones to stop."""
        record = await self.sweeps.get(tenant, sweep_id)
        await self.sweeps.mark(tenant, sweep_id, cancel=True)
        await self._cancel_runs(tenant, record)
        logger.info("sweep %s cancelled by tenant %s", sweep_id, tenant)
        return await self.get(tenant, sweep_id)

    async def _delete_jobs(self, tenant: str, job_ids: list[str], *, force: bool) -> list[str]:
        """Delete the jobs as DeleteJob does; the ids of those deleted (not already gone)."""
        return await _each_found(job_ids, lambda job: self.jobs.delete(tenant, job, force=force))

    async def _cancel_runs(self, tenant: str, record: SweepRecord) -> None:
        await _each_found(record.job_ids, lambda job: self.jobs.cancel(tenant, job))

    async def delete(
        self, tenant: str, sweep_id: str, *, force: bool = False, keep_runs: bool = False
    ) -> list[str]:
        """Delete the sweep and (unless ``keep_runs``) its runs' jobs; returns the ids of the
        jobs deleted. Runs still QUEUED or RUNNING need ``force``, else FailedPreconditionError;
        NotFoundError when unknown or another tenant's."""
        record = await self.sweeps.get(tenant, sweep_id)
        deleted: list[str] = []
        if keep_runs:
            await self.jobs.untag_sweep(record.job_ids)
        else:
            runs = await self._runs(record)
            if _state(record, runs) == pb.SWEEP_STATE_RUNNING and not force:
                active = sum(_active(run) for run in runs)
                raise FailedPreconditionError(
                    f"sweep {sweep_id} is running ({active} runs queued or running, "
                    f"{len(record.job_ids)} of {record.run_count} created); cancel it "
                    "(CancelSweep) and delete it once its runs ended, or pass force=true "
                    "(`ssdrbm sweep-delete --force`) to cancel and delete them now",
                    precondition="SWEEP_ACTIVE",
                    subject=f"sweep:{sweep_id}",
                )
            await self.sweeps.mark(tenant, sweep_id, cancel=True)  # a half-done delete shows it
            deleted = await self._delete_jobs(tenant, record.job_ids, force=force)
        listed = await self._remove(record)
        # Runs that a StartSweep still creating the sweep (so it was RUNNING: force was needed)
        # added after the read above; from the delete on it can add none (SweepStore.add_run).
        late = [job_id for job_id in listed if job_id not in record.job_ids]
        if keep_runs:
            await self.jobs.untag_sweep(late)
        else:
            deleted += await self._delete_jobs(tenant, late, force=force)
        logger.info(
            "sweep %s deleted by tenant %s (%d jobs, keep_runs=%s)",
            sweep_id,
            tenant,
            len(deleted),
            keep_runs,
        )
        return deleted

    async def stream(self, tenant: str, sweep_id: str) -> AsyncIterator[pb.SweepUpdate]:
        """The leaderboard on every change and at least every HEARTBEAT_S; ends after the
        update that shows the sweep ended."""
        last: bytes | None = None
        sent_at = 0.0
        while True:
            sweep = await cancellable(self.get(tenant, sweep_id))  # a gone client ends it
            snapshot = sweep.SerializeToString()
            now = time.monotonic()
            ended = sweep.state != pb.SWEEP_STATE_RUNNING
            if snapshot != last or now - sent_at >= HEARTBEAT_S or ended:
                update = pb.SweepUpdate(sweep=sweep)
                update.time.GetCurrentTime()
                yield update
                last, sent_at = snapshot, now
            if ended:
                return
            await asyncio.sleep(POLL_S)

    async def _remove(self, record: SweepRecord) -> list[str]:
        """Delete the sweep's own keys (SweepStore.delete, with its request_id's key); the runs'
        job ids as the deletion found them."""
        request_id = pb.StartSweepRequest.FromString(record.request).request_id
        return await self.sweeps.delete(record.tenant, record.id, request_id)

    async def expire_if_done(self, tenant: str, sweep_id: str) -> str:
        """Delete the sweep's keys if none of its runs' jobs is left (they expired); else say
        why not: GONE (no such sweep), ACTIVE (a run's job is queued or running: its end
        schedules the sweep again) or WAITING (a run's job ended but is still stored)."""
        try:
            record = await self.sweeps.get(tenant, sweep_id)
        except NotFoundError:
            return GONE
        runs = await self._runs(record)
        # A sweep whose runs are not all created is not waited for: its entry is due a TTL after
        # a run's end, and a StartSweep still creating runs after the sweep is gone removes the
        # run it adds (SweepStore.add_run); one that died half-way is not coming back.
        if any(_active(run) for run in runs):
            return ACTIVE
        if not all(run.expired for run in runs):
            return WAITING
        try:
            await self._remove(record)
        except NotFoundError:
            return GONE  # deleted meanwhile
        logger.info("sweep %s of tenant %s expired with its runs", sweep_id, tenant)
        return EXPIRED

    async def _to_proto(self, record: SweepRecord) -> pb.Sweep:
        request = pb.StartSweepRequest.FromString(record.request)
        sweep = pb.Sweep(
            id=record.id,
            name=record.name,
            request=request,
            run_count=record.run_count,
            cancel_requested=record.cancel_requested,
        )
        sweep.created_at.FromNanoseconds(int(record.created_at * 1e9))
        runs = await self._runs(record)
        _rank(runs, record.rank_metric)
        sweep.runs.extend(sorted(runs, key=lambda run: (run.rank == 0, run.rank)))
        if sweep.runs and sweep.runs[0].rank == 1:
            sweep.best_job_id = sweep.runs[0].job_id
        sweep.state = _state(record, runs)
        return sweep

    async def _runs(self, record: SweepRecord) -> list[pb.SweepRun]:
        async with self.jobs.redis.pipeline(transaction=False) as pipe:
            for job_id in record.job_ids:
                pipe.hmget(self.jobs.keys.job(job_id), _RUN_FIELDS)
            replies = await pipe.execute()
        runs = []
        for index, (job_id, reply) in enumerate(zip(record.job_ids, replies, strict=True)):
            state, step, total, metrics, error = reply
            point = record.points[index] if index < len(record.points) else {}
            if state is None:  # deleted, or expired after finished_job_ttl_seconds
                runs.append(pb.SweepRun(job_id=job_id, point=point, expired=True))
                continue
            run = pb.SweepRun(
                job_id=job_id,
                point=point,
                state=convert.state_to_proto(JobState(state.decode())),
                step=int(step or 0),
                total_steps=int(total or 0),
                error=(error or b"").decode(),
            )
            if metrics:
                run.latest_metrics.ParseFromString(metrics)
            runs.append(run)
        return runs


async def _each_found(job_ids: list[str], act: Callable[[str], Awaitable[object]]) -> list[str]:
    """``act`` on each job; the ids of those it found (a job gone already, deleted by its
    owner or expired, is passed over)."""
    found = []
    for job_id in job_ids:
        with contextlib.suppress(NotFoundError):
            await act(job_id)
            found.append(job_id)
    return found


def _rank(runs: list[pb.SweepRun], metric: str) -> None:
    """Set each run's rank (1 = best) by its latest value of ``metric``; 0 without one."""
    scored = []
    for position, run in enumerate(runs):
        value = metric_value(run.latest_metrics, metric) if run.HasField("latest_metrics") else None
        if value is not None:
            run.rank_value = value
            scored.append((signed_value(value, metric), position, run))
    for rank, (_, _, run) in enumerate(sorted(scored, key=lambda item: item[:2]), start=1):
        run.rank = rank


def _deleted_while_created(sweep_id: str) -> NotFoundError:
    """StartSweep's answer when a DeleteSweep removed the sweep before it was done."""
    return NotFoundError(
        f"sweep {sweep_id} was deleted while StartSweep created its runs; the runs were removed "
        "with it",
        resource_type="sweep",
        resource_name=sweep_id,
    )


def _active(run: pb.SweepRun) -> bool:
    """True while the run's job is QUEUED or RUNNING (a gone job is not)."""
    return not run.expired and run.state not in convert.TERMINAL_PROTO_STATES


def _state(record: SweepRecord, runs: list[pb.SweepRun]) -> int:
    """The sweep's state, read from its runs: it is never stored."""
    if not record.cancel_requested and len(record.job_ids) < record.run_count:
        return pb.SWEEP_STATE_RUNNING  # still being created
    if any(_active(run) for run in runs):
        return pb.SWEEP_STATE_RUNNING
    if record.cancel_requested:
        return pb.SWEEP_STATE_CANCELLED
    states = {run.state for run in runs if not run.expired}
    if not states:
        return pb.SWEEP_STATE_EXPIRED
    if states & {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_STOPPED}:
        return pb.SWEEP_STATE_SUCCEEDED
    if pb.JOB_STATE_CANCELLED in states:
        return pb.SWEEP_STATE_CANCELLED
    return pb.SWEEP_STATE_FAILED


def _point_error(
    error: InvalidArgumentError, axes: list[sweep_axes.Axis], point: sweep_axes.Point, index: int
) -> InvalidArgumentError:
    """The resolver's refusal of one point, naming the axis and its value when an axis set
    the field (else the base request's field)."""
    where = _where(index, point)
    for axis in axes:
        if axis.sets(error.field):
            value = sweep_axes.format_value(axis.field, point[axis.field])
            return InvalidArgumentError(
                axis.where, f"{axis.field} = {value} is refused: {error.description} ({where})"
            )
    return InvalidArgumentError(f"base.{error.field}", f"{error.description} ({where})")


def _where(index: int, point: sweep_axes.Point) -> str:
    """``sweep point 3 (optimizer.lr=0.01 training.seed=2)``, for messages."""
    return f"sweep point {index} ({sweep_axes.describe(point)})"


def _unsubmitted(
    resolved: pb.StartSweepRequest, points: list[dict[str, str]], jobs: list[resolver.ResolvedJob]
) -> pb.Sweep:
    """What StartSweep would create for validate_only: no ids, nothing stored."""
    sweep = pb.Sweep(name=resolved.name, request=resolved, run_count=len(jobs))
    for point, job in zip(points, jobs, strict=True):
        sweep.runs.add(point=point, total_steps=job.total_steps)
    return sweep
