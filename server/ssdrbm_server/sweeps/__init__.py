"""Sweeps: many ordinary training jobs from one request, ranked live, with optional
successive-halving early stopping (ASHA): ``axes.py`` the fields varied and the points,
``ranking.py`` whether the runs report the rank metric, ``rungs.py`` the rung schedule (the
decision at a rung: store/rungs.py), ``store.py`` the sweep record, ``service.py`` the RPCs.
"""
