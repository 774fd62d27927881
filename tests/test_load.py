"""The quick variant of the load test (bench/load.py): queued jobs across two worker processes,
concurrent metric subscribers and serving calls, one worker SIGKILLed mid-job, and a cancel.
It asserts what the run checked (every job SUCCEEDED, each subscriber saw every step exactly
once and the same events as a replay, every serving call succeeded, and a soak of a handful of
jobs submitted, finished and deleted left Redis's key count at its baseline and its memory within
the stated tolerance, and a second tenant's first job, submitted behind a backlog of the first
tenant's jobs, waited at most one job slot per worker); its latencies are only reported, by
`python -m bench.load`."""

from __future__ import annotations

from bench.load import LoadConfig, run


def test_quick_load_loses_no_job_and_no_event() -> None:
    config = LoadConfig.quick()
    report = run(config)
    assert report.ok, report.failures
    assert report.jobs_total == config.jobs + 1  # and the job whose worker was killed
    assert report.jobs_succeeded == report.jobs_total
    per_job_events = config.steps // config.eval_every + 3  # metrics, QUEUED, RUNNING, end
    assert report.events_received >= config.subscribers * per_job_events
    assert report.recovery_s is not None and report.cancel_s is not None
    served = report.latencies_ms["Reconstruct (32x16)"]["count"]
    served += report.latencies_ms["SampleHidden (32x16)"]["count"]
    assert served == config.serving_calls
    soak = report.soak
    assert soak is not None and soak["jobs"] == config.soak_jobs
    assert soak["peak_keys"] > soak["baseline_keys"]  # the jobs were there, so the check can fail
    assert soak["after_keys"] == soak["baseline_keys"]
    grown = soak["after_key_bytes"] - soak["baseline_key_bytes"]
    assert grown <= soak["memory_tolerance_bytes"]
    fairness = report.fairness
    assert fairness is not None and fairness["tenant_a_jobs"] == config.fairness_jobs
    assert fairness["a_queued_at_b_submit"] > fairness["workers"]  # a backlog B could wait behind
    # The promise: another tenant's backlog delays B's first job by at most one slot per worker.
    assert fairness["a_started_after_b_submit_before_b"] <= fairness["workers"]
    assert fairness["within_promise"]
