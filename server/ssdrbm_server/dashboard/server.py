"""The dashboard's routes, mounted by the HTTP front under ``DASHBOARD_PATH`` (http_front.py).

The pages (``/``, ``/jobs/{id}``, ``/sweeps/{id}``) hold no data, so they are open: all are
``static/index.html``, whose script (``static/dashboard.js``) draws what the JSON routes under
``/api`` answer behind the front's ``RequestGate`` (bearer token, request slot). The lists
answer the tenant's newest ``LIST_LIMIT`` jobs or sweeps, and the pages poll them and a sweep's
leaderboard every two seconds: one small request, where a stream per job listed would take the
stream slots. A job's ``history`` is a replay of the servicer's own metric stream
(``history_only``, at most ``HISTORY_LIMIT`` events) in one of the tenant's stream slots, held
only while it reads; ``filters.png`` loads the latest checkpoint through the serving cache (412
without one).

``/api/jobs/{id}/events?ticket=...&after=...`` is the job's metric events as server-sent events
(``id:`` the resume token, ``event:`` metrics, state or backoff, ``data:`` JSON), then ``event:
end`` once the job has ended, or ``event: failed`` with the error's message (e.g. at shutdown;
the page reconnects from its last id). An EventSource cannot send a bearer header, so it shows
a ticket (tickets.py). It is the servicer's own metric stream (``RBMServicer.metric_events``), so
a browser counts against ``SSDRBM_MAX_STREAMS_PER_TENANT`` as a StreamMetrics call does, and a
refusal is answered before the stream starts.

A running job's ETA comes with its JSON and each metrics event, computed by the SDK's one rule
(``ssdrbm.progress.ProgressState.eta_s``, which ``ssdrbm watch`` uses), so the page and the CLI
agree; a state event that preempted or resumed a job says so in ``marker``, which the page
draws on the curves.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any

from ssdrbm.events import QueuePlace as SdkQueuePlace
from ssdrbm.progress import ProgressState, format_duration
from ssdrbm.v1 import rbm_pb2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ssdrbm_server import convert
from ssdrbm_server.dashboard.filters import MAX_FILTER_PIXELS, MAX_FILTERS, filters_png, image_shape
from ssdrbm_server.dashboard.tickets import StreamTickets
from ssdrbm_server.errors import ServiceError
from ssdrbm_server.http_front import RequestGate, error_response
from ssdrbm_server.rank_metrics import metric_value, resolve_rank_metric
from ssdrbm_server.servicer import RBMServicer
from ssdrbm_server.store.events import check_token
from ssdrbm_server.store.queue import QueuePlace
from ssdrbm_server.store.records import JobRecord, JobState

# A state event's message, as the worker writes it: a release at a time slice's end starts with
# this (worker/runner.py PREEMPTED); a claim that restarts from a checkpoint says "resuming"
# (store/leases.py).
PREEMPTED_PREFIX = "preempted"
RESUMING_WORD = "resuming"
LIST_LIMIT = 100  # jobs (and sweeps) a list shows, newest first
HISTORY_LIMIT = 2000  # metric events one history request reads; the page asks again for more
BASE_MARK = "__BASE__"  # where index.html names the mount path
STATIC = {  # file → media type: everything the pages load, all from the package
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
# The pages load only their own script and style, and talk only to their own origin.
PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
}


def _static(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def dashboard_app(servicer: RBMServicer, gate: RequestGate) -> Starlette:
    """The dashboard as an ASGI app, for ``HttpFront.mount_dashboard``."""
    dashboard = Dashboard(servicer)
    return Starlette(
        routes=[
            Route("/", dashboard.page, methods=["GET"]),
            Route("/jobs/{job_id}", dashboard.page, methods=["GET"]),
            Route("/sweeps/{sweep_id}", dashboard.page, methods=["GET"]),
            Route("/static/{name}", dashboard.static, methods=["GET"]),
            Route("/api/jobs", gate.route(dashboard.jobs), methods=["GET"]),
            Route("/api/jobs/{job_id}", gate.route(dashboard.job), methods=["GET"]),
            Route("/api/jobs/{job_id}/ticket", gate.route(dashboard.ticket), methods=["POST"]),
            Route("/api/jobs/{job_id}/events", dashboard.events, methods=["GET"]),
            Route("/api/jobs/{job_id}/history", gate.route(dashboard.history), methods=["GET"]),
            Route("/api/jobs/{job_id}/filters.png", gate.route(dashboard.filters), methods=["GET"]),
            Route("/api/sweeps", gate.route(dashboard.sweeps), methods=["GET"]),
            Route("/api/sweeps/{sweep_id}", gate.route(dashboard.sweep), methods=["GET"]),
        ]
    )


class Dashboard:
    """The routes' handlers over the servicer's stores and metric streams."""

    def __init__(self, servicer: RBMServicer) -> None:
        self.servicer = servicer
        self.tickets = StreamTickets()
        self._index = _static("index.html")
        self._files = {name: _static(name) for name in STATIC}

    async def page(self, request: Request) -> Response:
        base = request.scope.get("root_path", "")
        return HTMLResponse(self._index.replace(BASE_MARK, base), headers=PAGE_HEADERS)

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return JSONResponse({"error": f"no dashboard file {name!r}"}, status_code=404)
        return Response(self._files[name], media_type=STATIC[name], headers=PAGE_HEADERS)

    async def jobs(self, request: Request, tenant: str) -> Response:
        records, more = await self.servicer.stores.jobs.list(
            tenant, page_size=LIST_LIMIT, page_token="", state=None
        )
        places = await self.servicer.queue_places(tenant, records)
        jobs = [job_json(record, places.get(record.id)) for record in records]
        return JSONResponse({"jobs": jobs, "more": bool(more)})

    async def job(self, request: Request, tenant: str) -> Response:
        record = await self.servicer.tenant_job(tenant, request.path_params["job_id"])
        places = await self.servicer.queue_places(tenant, [record])
        return JSONResponse(job_json(record, places.get(record.id)))

    async def ticket(self, request: Request, tenant: str) -> Response:
        record = await self.servicer.tenant_job(tenant, request.path_params["job_id"])
        return JSONResponse({"ticket": self.tickets.issue(tenant, record.id)})

    async def history(self, request: Request, tenant: str) -> Response:
        """The job's points of ``metric`` after ``after``: {points: [[step, value]], after,
        more}; ``more`` when the read stopped at HISTORY_LIMIT events."""
        record = await self.servicer.tenant_job(tenant, request.path_params["job_id"])
        metric = resolve_rank_metric(request.query_params.get("metric", ""))
        after = request.query_params.get("after", "")
        check_token(after)
        points: list[list[float]] = []
        read = 0
        async with self.servicer.metric_events(record, after, history_only=True) as events:
            async for event in events:
                read += 1
                after = event.resume_token or after
                value = metric_value(event.metrics, metric) if event.HasField("metrics") else None
                if value is not None:
                    points.append([event.metrics.step, value])
                again = retrained_after(event)
                if again is not None:
                    points = [p for p in points if p[0] <= again]
                if read >= HISTORY_LIMIT:
                    break
        return JSONResponse({"points": points, "after": after, "more": read >= HISTORY_LIMIT})

    async def filters(self, request: Request, tenant: str) -> Response:
        """The latest checkpoint's filters as a PNG."""
        record = await self.servicer.tenant_job(tenant, request.path_params["job_id"])
        loaded = await self.servicer.models.model_for(record, 0)
        # Cut to what the picture shows before copying: a large model's W stays where it is.
        weights = loaded.model.W.detach()[:MAX_FILTER_PIXELS, :MAX_FILTERS].cpu().float().numpy()
        image = filters_png(weights, image_shape(record.spec, loaded.n_visible))
        return Response(
            image,
            media_type="image/png",
            headers={"cache-control": "no-store", "x-checkpoint-step": str(loaded.step)},
        )

    async def sweeps(self, request: Request, tenant: str) -> Response:
        answer = await self.servicer.sweeps.list(tenant, page_size=LIST_LIMIT, page_token="")
        sweeps = [sweep_json(sweep) for sweep in answer.sweeps]
        return JSONResponse({"sweeps": sweeps, "more": bool(answer.next_page_token)})

    async def sweep(self, request: Request, tenant: str) -> Response:
        sweep = await self.servicer.sweeps.get(tenant, request.path_params["sweep_id"])
        return JSONResponse(sweep_json(sweep))

    async def events(self, request: Request) -> Response:
        """The job's events as server-sent events, in one of the tenant's stream slots."""
        job_id = request.path_params["job_id"]
        streaming = contextlib.AsyncExitStack()
        try:
            tenant = self.tickets.redeem(request.query_params.get("ticket", ""), job_id)
            record = await self.servicer.tenant_job(tenant, job_id)
            after = request.query_params.get("after", "")
            check_token(after)  # a bad one is 400 here, not an error inside a started stream
            events = await streaming.enter_async_context(self.servicer.metric_events(record, after))
        except Exception as exc:  # refused before the stream starts: a JSON error
            await streaming.aclose()
            return error_response(request, exc)
        return EventStream(_server_sent(events), on_close=streaming.aclose)


class EventStream(StreamingResponse):
    """A ``text/event-stream`` answer that runs ``on_close`` however it ends (the job ended,
    the client went away, shutdown): that releases the stream's slot and follower."""

    def __init__(
        self, content: AsyncIterator[str], *, on_close: Callable[[], Awaitable[Any]]
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _server_sent(events: AsyncIterator[rbm_pb2.MetricEvent]) -> AsyncIterator[str]:
    try:
        async for event in events:
            kind = event.WhichOneof("event")
            yield sse(kind, event_json(event), event.resume_token)
    except ServiceError as exc:  # e.g. shutting down: the page reconnects from its last id
        yield sse("failed", {"error": str(exc)})
        return
    yield sse("end", {})


def sse(kind: str, data: dict[str, Any], event_id: str = "") -> str:
    """One server-sent event (JSON never holds a raw newline, so ``data`` is one line)."""
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def job_json(record: JobRecord, place: QueuePlace | None = None) -> dict[str, Any]:
    """What the pages show of a job; a queued one's place in the queue in the SDK's words."""
    job = convert.job_to_proto(record, place)
    latest = job.latest_metrics if job.HasField("latest_metrics") else None
    return {
        "id": record.id,
        "name": record.name,
        "state": record.state.value,
        "step": record.step,
        "total_steps": record.total_steps,
        "reconstruction_error": None if latest is None else _finite(latest.reconstruction_error),
        **_eta_json(latest if record.state is JobState.RUNNING else None),
        "backoffs": record.backoffs,
        "error": record.error,
        "checkpoint_step": record.checkpoint_step,
        "queue": None if place is None else _queue_json(job.queue),
    }


def _queue_json(message: rbm_pb2.QueuePlace) -> dict[str, Any]:
    place = SdkQueuePlace.from_proto(message)
    return {
        "position": place.position,
        "starts_in_s": place.starts_in_s,
        "no_worker": place.no_worker,
        "summary": place.summary(),
        "basis": place.basis,
    }


def sweep_json(sweep: rbm_pb2.Sweep) -> dict[str, Any]:
    """What the pages show of a sweep: its leaderboard in rank order, best first."""
    return {
        "id": sweep.id,
        "name": sweep.name,
        "state": rbm_pb2.SweepState.Name(sweep.state).removeprefix("SWEEP_STATE_"),
        "run_count": sweep.run_count,
        "best_job_id": sweep.best_job_id,
        "rank_metric": sweep.request.rank_metric,
        "runs": [run_json(run) for run in sweep.runs],
    }


def run_json(run: rbm_pb2.SweepRun) -> dict[str, Any]:
    state = convert.state_from_proto(run.state)
    return {
        "job_id": run.job_id,
        "point": dict(run.point),
        "state": "EXPIRED" if run.expired else (state.value if state is not None else ""),
        "step": run.step,
        "total_steps": run.total_steps,
        "rank": run.rank,
        "rank_value": _finite(run.rank_value) if run.rank else None,
        "error": run.error,
    }


def event_json(event: rbm_pb2.MetricEvent) -> dict[str, Any]:
    """What the curves need of a metric event: the numbers a chart plots, by event kind."""
    kind = event.WhichOneof("event")
    if kind == "metrics":
        metrics = event.metrics
        return {
            "step": metrics.step,
            "total_steps": metrics.total_steps,
            "reconstruction_error": metric_value(metrics, "reconstruction_error"),
            "log_likelihood": metric_value(metrics, "log_likelihood"),
            "log_likelihood_stderr": metric_value(metrics, "log_likelihood_stderr"),
            "log_likelihood_lower": metric_value(metrics, "log_likelihood_lower"),
            "log_likelihood_lower_stderr": metric_value(metrics, "log_likelihood_lower_stderr"),
            "lr": metric_value(metrics, "lr"),
            **_eta_json(metrics),
        }
    if kind == "backoff":
        backoff = event.backoff
        return {
            "step": backoff.step,
            "rollback_step": backoff.rollback_step,
            "reason": backoff.reason,
            "old_lr": backoff.old_lr,
            "new_lr": backoff.new_lr,
        }
    state = convert.state_from_proto(event.state.state)
    return {
        "state": state.value if state is not None else "",
        "message": event.state.message,
        "step": event.state.step,
        "marker": state_marker(event.state),
    }


def retrained_after(event: rbm_pb2.MetricEvent) -> int | None:
    """The step after which the job trains again (a backoff's rollback, or a resumption from a
    checkpoint): the points after it are replaced by new ones. None for any other event."""
    if event.HasField("backoff"):
        return event.backoff.rollback_step
    if event.HasField("state") and state_marker(event.state) == "resumed":
        return event.state.step
    return None


def state_marker(change: rbm_pb2.StateChange) -> str | None:
    """What a state change marks on the curves: "preempted" (released at a time slice's end),
    "resumed" (claimed again from a checkpoint: after a preemption, or a worker lost), else
    None."""
    state = convert.state_from_proto(change.state)
    if state is JobState.QUEUED and change.message.startswith(PREEMPTED_PREFIX):
        return "preempted"
    if state is JobState.RUNNING and RESUMING_WORD in change.message:
        return "resumed"
    return None


def _eta_json(metrics: rbm_pb2.Metrics | None) -> dict[str, Any]:
    """The time left at the average pace so far, as ``ssdrbm watch`` shows it; None without
    metrics (a job that is not running, or before its first timed step)."""
    if metrics is None:
        return {"eta_s": None, "eta": None}
    progress = ProgressState(
        "", step=metrics.step, total_steps=metrics.total_steps, wall_time_s=metrics.wall_time_s
    )
    eta_s = progress.eta_s()
    return {"eta_s": eta_s, "eta": None if eta_s is None else format_duration(eta_s)}


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity (a blown-up run reports them): null, a gap in the curve."""
    return value if math.isfinite(value) else None
