"""Benchmarks of ssdrbm: the core's training step, the comparison with scikit-learn, the service.

Run `python -m bench [core|sklearn|service|all] [--json] [--quick]`; see docs/PERFORMANCE.md.
"""
