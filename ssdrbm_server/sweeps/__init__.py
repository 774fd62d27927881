"""Sweeps: many ordinary training jobs from one request, ranked live, with optional
successive-halving early stopping (ASHA).

- ``ranking.py``: the rank metrics and their direction (the one place), leaderboard order,
  and whether a sweep's runs report its rank metric (asked of the worker's evaluation).
- ``axes.py``: the fields a sweep may vary, the grid and the random draws, one point → request
  (their sizes are bounded first, from the request's numbers: ssdrbm_server/request_bounds.py).
- ``rungs.py``: the rung schedule, and the ASHA decision as one Redis script (``RungGate``,
  called by the worker when a run reports metrics).
- ``store.py``: the sweep record in Redis (tenant slot), its runs and listing.
- ``service.py``: the RPCs (StartSweep, GetSweep, ListSweeps, CancelSweep, StreamSweep,
  DeleteSweep).
"""
