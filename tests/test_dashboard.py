"""The dashboard (ssdrbm_server.dashboard) in a real headless Chromium, against the real service
(gRPC API, in-process worker, Redis) with token authentication on for two tenants: signing in
with a token, the jobs list showing a running job and its ETA, its curve growing as it trains,
another tenant's job invisible; a job's likelihood bounds as two lines; preemption markers; a
running sweep's leaderboard and its runs' curves; a model's filters;
then its event stream over plain HTTP: tickets, stream slots shared with StreamMetrics, and the
job's one shared follower; a queued job's place in the queue. Screenshots go to
test-artifacts/."""

from __future__ import annotations

import http.client
import json
import struct
import time
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.dashboard.filters import MAX_FILTERS, filters_png, image_shape
from ssdrbm_server.dashboard.server import event_json, retrained_after, state_marker
from ssdrbm_server.dashboard.tickets import MAX_TICKETS, TICKET_TTL_S, StreamTickets
from ssdrbm_server.errors import ResourceExhaustedError, UnauthenticatedError
from ssdrbm_server.http_front import DASHBOARD_PATH
from ssdrbm_server.worker.runner import PREEMPTED
from tests.fixtures.browser import Browser
from tests.fixtures.jobs import Follower, tiny_request
from tests.fixtures.redis import free_port
from tests.fixtures.service import RunningService
from tests.test_http_front import wait_for
from tests.test_worker import diverging_spec

ALPHA, BETA = "alpha-dashboard-token", "beta-dashboard-token"
WAIT_S = 90.0  # a bound for a loaded 2-core machine, not a speed check
# Long enough to be watched while it trains; each test cancels it when done.
LONG_JOB = {"steps": 200_000, "eval": pb.EvalSpec(every=25, validation_fraction=0.2)}
POINTS = "Number(document.getElementById('chart-reconstruction_error').dataset.points)"


@pytest.fixture
def dashboard(service_factory: Callable[..., RunningService]) -> RunningService:
    """The service with token auth for tenants alpha and beta, its HTTP front on a free port."""
    return service_factory(
        auth_mode="token",
        auth_tokens=f"{ALPHA}=alpha,{BETA}=beta",
        http_port=free_port(),
        max_streams_per_tenant=2,
    )


def url(running: RunningService, path: str = "/") -> str:
    return f"http://127.0.0.1:{running.settings.http_port}{DASHBOARD_PATH}{path}"


def start_running_job(running: RunningService) -> str:
    """A long job of alpha's, once a worker runs it."""
    stub = running.stub(token=ALPHA)
    job_id = stub.StartTraining(tiny_request(**LONG_JOB), timeout=30).job.id
    deadline = time.monotonic() + WAIT_S
    while stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=30).state != pb.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.2)
    return job_id


def ended_job(running: RunningService, job_id: str) -> pb.Job:
    """Alpha's job ``job_id`` once it has ended."""
    stub = running.stub(token=ALPHA)
    deadline = time.monotonic() + WAIT_S
    while not (job := stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=30)).finished_at.seconds:
        assert time.monotonic() < deadline, f"job {job_id} did not end"
        time.sleep(0.2)
    return job


def cancel(running: RunningService, job_id: str) -> None:
    running.stub(token=ALPHA).CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=30)


def sign_in(browser: Browser, running: RunningService, token: str) -> None:
    """Open the jobs page, which asks for a token, and sign in with ``token``."""
    browser.navigate(url(running))
    browser.wait_for("!document.getElementById('login').hidden", what="the sign-in form")
    browser.evaluate(
        f"document.getElementById('token').value = {json.dumps(token)};"
        "document.getElementById('login').requestSubmit()"
    )
    browser.wait_for("!document.getElementById('jobs-view').hidden", what="the jobs list")


def test_the_jobs_page_lists_a_running_job_whose_curve_grows(
    dashboard: RunningService, browser: Browser
) -> None:
    job_id = start_running_job(dashboard)
    try:
        sign_in(browser, dashboard, ALPHA)
        row = f"document.querySelector('tr[data-job-id=\"{job_id}\"]')"
        browser.wait_for(f"{row} && {row}.innerText.includes('RUNNING')", what="the job's row")
        assert browser.evaluate("sessionStorage.getItem('ssdrbm-token')") == ALPHA
        # Its time left, as `ssdrbm watch` writes it (m:ss or h:mm:ss), once it has metrics.
        eta = f"{row}.querySelector('td.eta').innerText"
        assert ":" in browser.wait_for(f"{eta}.includes(':') && {eta}", what="the job's ETA")
        browser.screenshot("dashboard-jobs")

        browser.evaluate(f"{row}.querySelector('a').click()")  # to the job's page
        first = browser.wait_for(f"{POINTS} >= 2 && {POINTS}", what="points on the curve")
        later = browser.wait_for(
            f"{POINTS} > {first} && {POINTS}", what=f"more than {first} points"
        )
        assert later > first
        assert browser.evaluate("Number(document.getElementById('chart-lr').dataset.points)") > 0
        summary = "document.getElementById('job-summary').innerText"
        browser.wait_for(f"{summary}.includes('ETA')", what="the ETA on the job's page")
        assert browser.evaluate("location.pathname") == f"{DASHBOARD_PATH}/jobs/{job_id}"
        browser.screenshot("dashboard-job")
    finally:
        cancel(dashboard, job_id)
    browser.wait_for(
        "document.getElementById('status').innerText.includes('ended')", what="the stream's end"
    )


def test_a_queued_jobs_row_shows_its_place_in_the_queue(
    service_factory: Callable[..., RunningService], browser: Browser
) -> None:
    """No worker runs here: after a lease length the queued job's row says so (with a worker it
    says "3 ahead; about 40 s", the same words as the CLI: ssdrbm.events.QueuePlace.summary)."""
    running = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens=f"{ALPHA}=alpha",
        http_port=free_port(),
        lease_seconds=1.5,
    )
    job_id = running.stub(token=ALPHA).StartTraining(tiny_request(), timeout=30).job.id
    sign_in(browser, running, ALPHA)
    queue = f"document.querySelector('tr[data-job-id=\"{job_id}\"] td.queue')"
    browser.wait_for(
        f"{queue} && {queue}.innerText === 'next; no worker is running'", what="the job's place"
    )
    browser.screenshot("dashboard-queued")


def test_another_tenants_job_is_not_visible(dashboard: RunningService, browser: Browser) -> None:
    job_id = start_running_job(dashboard)
    try:
        sign_in(browser, dashboard, BETA)
        browser.wait_for(
            "!document.getElementById('jobs-empty').hidden", what="beta's empty jobs list"
        )
        assert browser.evaluate("document.querySelectorAll('#jobs tbody tr').length") == 0
        browser.screenshot("dashboard-other-tenant")

        # Alpha's job and a job that does not exist read alike to beta.
        status = "document.getElementById('status').innerText"
        browser.navigate(url(dashboard, f"/jobs/{job_id}"))
        theirs = browser.wait_for(f"{status}.includes('not found') && {status}", what="404")
        browser.navigate(url(dashboard, "/jobs/no-such-job"))
        missing = browser.wait_for(f"{status}.includes('not found') && {status}", what="404")
        assert theirs.replace(job_id, "ID") == missing.replace("no-such-job", "ID")
        assert browser.evaluate(f"{POINTS}") == 0
        for path in (f"/api/jobs/{job_id}", f"/api/jobs/{job_id}/ticket"):
            method = "POST" if path.endswith("ticket") else "GET"
            status_code, answer = request(dashboard, method, path, BETA)
            assert status_code == 404 and job_id in answer["error"], answer
    finally:
        cancel(dashboard, job_id)


def test_backoffs_are_marked_on_the_curves_of_an_ended_job(
    dashboard: RunningService, browser: Browser
) -> None:
    """A job that blew up and was rolled back (test_worker's diverging job): once it has ended,
    its page replays the whole stream, one marker per backoff on each curve, then says so."""
    stub = dashboard.stub(token=ALPHA)
    job = ended_job(dashboard, stub.StartTraining(diverging_spec(steps=60), timeout=30).job.id)
    job_id = job.id
    assert job.state == pb.JOB_STATE_SUCCEEDED and job.backoffs >= 1, job

    sign_in(browser, dashboard, ALPHA)
    browser.navigate(url(dashboard, f"/jobs/{job_id}"))
    status = "document.getElementById('status').innerText"
    browser.wait_for(f"{status}.includes('ended')", what="the replayed stream's end")
    markers = "document.querySelectorAll('#chart-reconstruction_error line.backoff').length"
    browser.wait_for(f"{markers} === {job.backoffs}", what=f"{job.backoffs} backoff markers")
    assert browser.evaluate(f"{POINTS}") > 0
    browser.screenshot("dashboard-backoffs")


def test_a_job_with_ais_shows_its_likelihood_and_lower_bound_as_two_lines(
    dashboard: RunningService, browser: Browser
) -> None:
    """eval.ais (test_service's AIS job, cut small): each checkpoint's event carries AIS's
    estimate and reverse AIS's lower bound, drawn as two labelled lines with ± stderr bands."""
    request = tiny_request(steps=20)
    request.training.checkpoint_every = 10
    request.eval.every = 10
    request.eval.ais, request.eval.ais_chains, request.eval.ais_betas = True, 16, 50
    started = dashboard.stub(token=ALPHA).StartTraining(request, timeout=30).job
    job = ended_job(dashboard, started.id)
    assert job.state == pb.JOB_STATE_SUCCEEDED, job

    sign_in(browser, dashboard, ALPHA)
    browser.navigate(url(dashboard, f"/jobs/{job.id}"))
    chart = "document.getElementById('chart-log_likelihood')"
    browser.wait_for(f"{chart}.dataset.lines === '2'", what="the estimate and the lower bound")
    labels = browser.evaluate(
        f"[...{chart}.querySelectorAll('text.series')].map((t) => t.textContent).join('|')"
    )
    assert labels == "AIS estimate|lower bound", labels
    assert browser.evaluate(f"{chart}.querySelectorAll('polyline.line.lower').length") == 1
    assert not browser.evaluate("document.getElementById('likelihood-bounds').hidden")
    browser.evaluate(f"{chart}.scrollIntoView()")
    browser.screenshot("dashboard-likelihood-bounds")


def test_a_preempted_jobs_curves_mark_its_preemption_and_resumption(
    service_factory: Callable[..., RunningService], browser: Browser
) -> None:
    """One worker slot, one-second time slices (test_time_slices forces preemptions so): beta's
    job waits, so alpha's long job is preempted at its slice's end, and resumes from its
    checkpoint once beta's has ended; its page marks both, each with its reason."""
    running = service_factory(
        auth_mode="token",
        auth_tokens=f"{ALPHA}=alpha,{BETA}=beta",
        http_port=free_port(),
        slice_seconds=1.0,
    )
    job_id = start_running_job(running)
    try:
        sign_in(browser, running, ALPHA)
        browser.navigate(url(running, f"/jobs/{job_id}"))
        browser.wait_for(f"{POINTS} >= 1", what="alpha's first points")
        running.stub(token=BETA).StartTraining(tiny_request(steps=10), timeout=30)
        marker = "document.querySelector('#chart-reconstruction_error line.{}')"
        title = browser.wait_for(
            f"{marker.format('resumed')} && {marker.format('preempted')}.textContent",
            what="the preemption and the resumption marked",
        )
        assert title.startswith("preempted at step ") and "another tenant's job waits" in title
        resumed = browser.evaluate(f"{marker.format('resumed')}.textContent")
        assert resumed.startswith("resumed at step ") and "resuming from step" in resumed
        browser.screenshot("dashboard-preempted")
    finally:
        cancel(running, job_id)


# --- sweeps and filters ----------------------------------------------------------------------

RUNS = "document.getElementById('chart-runs').dataset"
BOARD = "document.querySelectorAll('#leaderboard tbody tr')"


def start_sweep(running: RunningService) -> pb.Sweep:
    """A sweep of alpha's: two long runs, one per step size."""
    base = tiny_request(**LONG_JOB)
    base.optimizer.ClearField("lr")
    axis = pb.SweepAxis(field="optimizer.lr", values=[0.05, 0.02])
    request = pb.StartSweepRequest(base=base, axes=[axis], name="lr-board")
    return running.stub(token=ALPHA).StartSweep(request, timeout=30)


def test_a_running_sweeps_leaderboard_ranks_its_runs_and_grows_as_they_train(
    dashboard: RunningService, browser: Browser
) -> None:
    sweep = start_sweep(dashboard)
    stub = dashboard.stub(token=ALPHA)
    try:
        sign_in(browser, dashboard, ALPHA)
        row = f"document.querySelector('tr[data-sweep-id=\"{sweep.id}\"]')"
        browser.wait_for(f"{row} && {row}.innerText.includes('lr-board')", what="the sweep's row")
        browser.screenshot("dashboard-sweeps")

        browser.evaluate(f"{row}.querySelector('a').click()")  # to the sweep's page
        browser.wait_for(f"{BOARD}.length === 2", what="both runs on the leaderboard")
        first = browser.wait_for(
            f"Number({RUNS}.points) >= 2 && Number({RUNS}.points)", what="a run's curve"
        )
        browser.wait_for(f"Number({RUNS}.points) > {first}", what=f"more than {first} points")
        # The board is the sweep as GetSweep ranks it: the best run first, and emphasized.
        best = stub.GetSweep(pb.GetSweepRequest(sweep_id=sweep.id), timeout=30).best_job_id
        assert best, "no run has a rank metric yet"
        top = browser.wait_for(
            f"{BOARD}[0].dataset.rank === '1' && {BOARD}[0].dataset.jobId", what="a best run"
        )
        assert top in {run.job_id for run in sweep.runs}
        assert browser.evaluate("document.querySelectorAll('#chart-runs .run.best').length") == 1
        assert browser.evaluate("location.pathname") == f"{DASHBOARD_PATH}/sweeps/{sweep.id}"
        browser.screenshot("dashboard-sweep")
    finally:
        stub.CancelSweep(pb.CancelSweepRequest(sweep_id=sweep.id), timeout=30)
    browser.wait_for(
        "document.getElementById('status').innerText.includes('ended')", what="the sweep's end"
    )

    # Beta sees neither the sweep nor its runs' histories: 404, worded like a missing one.
    status, theirs = request(dashboard, "GET", f"/api/sweeps/{sweep.id}", BETA)
    _, missing = request(dashboard, "GET", "/api/sweeps/no-such-sweep", ALPHA)
    assert status == 404
    assert theirs["error"].replace(sweep.id, "ID") == missing["error"].replace(
        "no-such-sweep", "ID"
    )
    run_id = sweep.runs[0].job_id
    assert request(dashboard, "GET", f"/api/jobs/{run_id}/history", BETA)[0] == 404
    status, answer = request(dashboard, "GET", "/api/sweeps", BETA)
    assert status == 200 and answer["sweeps"] == [], answer


def test_the_filters_of_a_job_with_a_checkpoint_are_shown_to_its_tenant_only(
    dashboard: RunningService, browser: Browser
) -> None:
    stub = dashboard.stub(token=ALPHA)
    job = ended_job(dashboard, stub.StartTraining(tiny_request(steps=40), timeout=30).job.id)
    job_id = job.id
    assert job.state == pb.JOB_STATE_SUCCEEDED, job

    sign_in(browser, dashboard, ALPHA)
    browser.navigate(url(dashboard, f"/jobs/{job_id}"))
    image = "document.getElementById('filters')"
    width = browser.wait_for(f"{image}.complete && {image}.naturalWidth", what="the filters image")
    # 8 hidden units of 16 = 4 × 4 visible units: a 3 × 3 grid of 4-pixel tiles, 1 pixel apart.
    assert width == 3 * 4 + 2 and browser.evaluate(f"{image}.naturalHeight") == 3 * 4 + 2
    assert not browser.evaluate("document.getElementById('section-filters').hidden")
    browser.evaluate(f"{image}.scrollIntoView()")
    browser.screenshot("dashboard-filters")

    status, theirs = request(dashboard, "GET", f"/api/jobs/{job_id}/filters.png", BETA)
    _, missing = request(dashboard, "GET", "/api/jobs/no-such-job/filters.png", BETA)
    assert status == 404
    assert theirs["error"].replace(job_id, "ID") == missing["error"].replace("no-such-job", "ID")


# --- the event stream over plain HTTP --------------------------------------------------------


def request(running: RunningService, method: str, path: str, token: str | None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", running.settings.http_port, timeout=30)
    try:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        connection.request(method, f"{DASHBOARD_PATH}{path}", headers=headers)
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


class EventStream:
    """One request for a job's event stream on its own connection, its headers read."""

    def __init__(self, running: RunningService, job_id: str, ticket: str) -> None:
        port = running.settings.http_port
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        path = f"{DASHBOARD_PATH}/api/jobs/{job_id}/events?ticket={ticket}"
        self.connection.request("GET", path)
        self.answer = self.connection.getresponse()
        self.status = self.answer.status

    def next_event(self) -> tuple[str, str, dict]:
        """(id, kind, data) of the next server-sent event."""
        fields: dict[str, str] = {}
        while (line := self.answer.readline().decode()) != "\n":
            name, _, value = line.rstrip("\n").partition(": ")
            fields[name] = value
        return fields.get("id", ""), fields["event"], json.loads(fields["data"])

    def error(self) -> str:
        return json.loads(self.answer.read())["error"]

    def close(self) -> None:
        self.answer.close()
        self.connection.close()


def ticket(running: RunningService, job_id: str) -> str:
    status, answer = request(running, "POST", f"/api/jobs/{job_id}/ticket", ALPHA)
    assert status == 200, answer
    return answer["ticket"]


def wait_for_subscribers(running: RunningService, job_id: str, count: int) -> None:
    """Until ``count`` streams follow the job live through its one shared follower."""
    assert running.service is not None
    fanout = running.service.servicer.fanout

    def subscribers() -> int:
        follower = fanout.follower(job_id)
        return 0 if follower is None else follower.subscribers

    wait_for(lambda: subscribers() == count, f"{count} streams on the follower", within_s=WAIT_S)


def test_event_streams_take_tickets_and_the_tenants_stream_slots_beside_stream_metrics(
    dashboard: RunningService,
) -> None:
    """Two slots for alpha (max_streams_per_tenant=2): a StreamMetrics call and one event
    stream share the job's one follower and fill them; a second event stream is refused (429)
    until the first closes. A ticket opens one stream only, and only for its own job."""
    job_id = start_running_job(dashboard)
    grpc_follower = Follower(dashboard.stub(token=ALPHA), job_id)
    try:
        first_ticket = ticket(dashboard, job_id)
        stream = EventStream(dashboard, job_id, first_ticket)
        assert stream.status == 200
        assert stream.answer.getheader("content-type", "").startswith("text/event-stream")
        kinds = []
        while not kinds or kinds[-1][0] != "metrics":
            token, kind, data = stream.next_event()
            assert token, "every event carries its resume token as its id"
            kinds.append((kind, data))
        assert kinds[0][0] == "state" and kinds[0][1]["state"] == "QUEUED", kinds
        assert kinds[-1][1]["step"] > 0 and kinds[-1][1]["lr"] > 0, kinds

        wait_for_subscribers(dashboard, job_id, 2)  # the gRPC stream and the event stream

        refused = EventStream(dashboard, job_id, ticket(dashboard, job_id))
        assert refused.status == 429
        assert "SSDRBM_MAX_STREAMS_PER_TENANT=2" in refused.error()

        spent = EventStream(dashboard, job_id, first_ticket)
        assert spent.status == 401 and "ticket" in spent.error()
        assert EventStream(dashboard, job_id, "").status == 401
        bad_after = EventStream(dashboard, job_id, f"{ticket(dashboard, job_id)}&after=x")
        assert bad_after.status == 400 and "after" in bad_after.error()
        other_job = dashboard.stub(token=ALPHA).StartTraining(tiny_request(), timeout=30).job.id
        assert EventStream(dashboard, job_id, ticket(dashboard, other_job)).status == 401

        stream.close()  # the slot comes back once the server sees it gone
        wait_for_subscribers(dashboard, job_id, 1)
        reopened = EventStream(dashboard, job_id, ticket(dashboard, job_id))
        assert reopened.status == 200
        reopened.close()
    finally:
        grpc_follower.cancel()
        cancel(dashboard, job_id)


def test_an_open_event_stream_ends_at_shutdown_without_holding_it_up(
    dashboard: RunningService,
) -> None:
    """Graceful shutdown ends a dashboard's live stream at once, with the reason (the page
    reconnects from its last id), as it does StreamMetrics calls; it does not wait for the job."""
    job_id = start_running_job(dashboard)
    stream = EventStream(dashboard, job_id, ticket(dashboard, job_id))
    assert stream.status == 200
    wait_for_subscribers(dashboard, job_id, 1)
    started = time.monotonic()
    dashboard.stop()
    stopped_s = time.monotonic() - started
    kinds = []
    while not kinds or kinds[-1][0] != "failed":
        _, kind, data = stream.next_event()
        kinds.append((kind, data))
    assert "shutting down" in kinds[-1][1]["error"], kinds[-1]
    assert stream.answer.read() == b""  # then the stream ends
    stream.close()
    assert stopped_s < WAIT_S / 3, f"shutdown took {stopped_s:.1f} s with a stream open"


def test_tickets_expire_and_are_bounded() -> None:
    now = [0.0]
    tickets = StreamTickets(clock=lambda: now[0])
    late = tickets.issue("alpha", "job-1")
    now[0] += TICKET_TTL_S
    with pytest.raises(UnauthenticatedError, match="expired"):
        tickets.redeem(late, "job-1")
    for _ in range(MAX_TICKETS):
        tickets.issue("alpha", "job-1")
    with pytest.raises(ResourceExhaustedError, match=f"{MAX_TICKETS} unused stream tickets"):
        tickets.issue("beta", "job-2")
    now[0] += TICKET_TTL_S  # expired ones make room again
    assert tickets.redeem(tickets.issue("beta", "job-2"), "job-2") == "beta"


def png_size_and_pixels(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and raw scanlines of one of filters.png's grayscale PNGs."""
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    idat = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[idat - 4 : idat])
    return width, height, zlib.decompress(data[idat + 4 : idat + 4 + length])


def image_spec(name: str) -> bytes:
    dataset = pb.DatasetRef(builtin=pb.BuiltinDataset(name=name))
    return tiny_request(dataset=dataset).SerializeToString()


def test_filters_take_the_datasets_image_shape_else_a_square_else_a_heat_map() -> None:
    assert image_shape(image_spec("freyface"), 560) == (28, 20)
    assert image_shape(image_spec("mnist"), 784) == (28, 28)
    assert image_shape(tiny_request().SerializeToString(), 16) == (4, 4)
    assert image_shape(tiny_request().SerializeToString(), 15) is None

    weights = np.random.default_rng(0).normal(size=(560, 10))
    width, height, raw = png_size_and_pixels(filters_png(weights, (28, 20)))
    assert (width, height) == (4 * 20 + 3, 3 * 28 + 2)  # 10 tiles: 4 across, 3 down
    assert len(raw) == height * (width + 1)

    # No shape: W as one heat-map, a row per hidden unit, bounded to MAX_FILTERS of them.
    width, height, _ = png_size_and_pixels(filters_png(np.ones((15, MAX_FILTERS + 5)), None))
    assert (width, height) == (15, MAX_FILTERS)


def metrics_event(step: int, total_steps: int, wall_time_s: float) -> pb.MetricEvent:
    metrics = pb.Metrics(step=step, total_steps=total_steps, wall_time_s=wall_time_s)
    return pb.MetricEvent(metrics=metrics)


def test_a_metrics_events_eta_is_the_steps_left_at_the_average_pace_so_far() -> None:
    """As ``ssdrbm watch`` computes it (ssdrbm.progress.ProgressState.eta_s)."""
    assert event_json(metrics_event(50, 200, 10.0))["eta_s"] == 30.0
    assert event_json(metrics_event(50, 200, 10.0))["eta"] == "0:30"
    assert event_json(metrics_event(200, 200, 40.0))["eta_s"] == 0.0
    assert event_json(metrics_event(0, 200, 0.0))["eta"] is None  # before its first timed step


def state_event(state: int, message: str, step: int = 40) -> pb.MetricEvent:
    return pb.MetricEvent(state=pb.StateChange(state=state, message=message, step=step))


def test_preemptions_and_resumptions_are_read_from_the_workers_state_messages() -> None:
    """Every release message of a preemption (worker/runner.py) marks one; a claim that resumes
    from a checkpoint marks a resumption, after which the steps are trained again."""
    for message in PREEMPTED.values():
        assert state_marker(state_event(pb.JOB_STATE_QUEUED, message).state) == "preempted"
    resumed = state_event(pb.JOB_STATE_RUNNING, "claimed by w-1, resuming from step 40")
    assert state_marker(resumed.state) == "resumed" and retrained_after(resumed) == 40
    first_claim = state_event(pb.JOB_STATE_RUNNING, "claimed by w-1", step=0)
    assert state_marker(first_claim.state) is None and retrained_after(first_claim) is None
    lost = state_event(pb.JOB_STATE_QUEUED, "worker lost; requeued")
    assert state_marker(lost.state) is None
    backoff = pb.MetricEvent(backoff=pb.Backoff(step=30, rollback_step=20))
    assert retrained_after(backoff) == 20
