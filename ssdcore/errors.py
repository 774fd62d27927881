"""Errors raised by ssdcore, in one place so callers can map them (e.g. to gRPC status codes)."""

from __future__ import annotations


class DivergenceError(RuntimeError):
    """A training step produced NaN or Inf in a parameter, gradient or metric.

    Raised instead of silently training on garbage; lower the learning rate or check the data.
    """
