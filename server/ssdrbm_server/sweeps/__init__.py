"""Sweeps: many ordinary training jobs from one request, ranked live, with optional
successive-halving early stopping (ASHA).

- ``ranking.py``: whether a sweep's runs report its rank metric (asked of the job spec's
  evaluation); the rank metrics and their direction are ssdrbm_server/rank_metrics.py.
- ``axes.py``: the fields a sweep may vary, the grid and the random draws, one point → request
  (their sizes are bounded first, from the request's numbers: ssdrbm_server/request_bounds.py).
- ``rungs.py``: the rung schedule; the ASHA decision at a rung is a store operation
  (ssdrbm_server/store/rungs.py: ``RungGate``, called by the worker when a run reports metrics).
- ``store.py``: the sweep record in Redis (tenant slot), its runs and listing.
- ``service.py``: the RPCs (StartSweep, GetSweep, ListSweeps, CancelSweep, StreamSweep,
  DeleteSweep).
"""
