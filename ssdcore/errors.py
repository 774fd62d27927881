"""Errors raised by ssdcore, in one place so callers can map them (e.g. to gRPC status codes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ssdcore.blowup import BlowUp


class DivergenceError(RuntimeError):
    """A training step produced NaN or Inf in a parameter, gradient or metric, or blew up. Raised
    instead of silently training on garbage; lower the learning rate or check the data. ``step`` is
    the step at which it was seen, when known; ``what`` says what went wrong in a few words (e.g.
    "parameters ['W'] became NaN or Inf"), without the advice of the message."""

    def __init__(self, message: str, *, step: int | None = None, what: str = "") -> None:
        super().__init__(message)
        self.step = step
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields do not survive the default exception pickling (which calls the
        # class with `args` alone); library users' process pools (multiprocessing, joblib)
        # carry a worker's exception back this way. The service never pickles: its training
        # process reports a failure as JSON (server/ssdrbm_server/worker/protocol.py).
        return (_rebuild, (type(self), self.args, self.__dict__))


class BlowUpError(DivergenceError):
    """Training blew up (see :mod:`ssdcore.blowup`) and the backoff budget is spent. ``blowup`` is
    the last blow-up, ``suggested_lr`` the step size to try next and ``history`` the metric history
    up to it (with its backoff entries)."""

    def __init__(
        self,
        message: str,
        *,
        blowup: BlowUp,
        suggested_lr: float,
        history: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(message, step=blowup.step)
        self.blowup = blowup
        self.suggested_lr = suggested_lr
        self.history = history or []


def _rebuild(cls: type[DivergenceError], args: tuple[Any, ...], fields: dict[str, Any]):
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(fields)
    return error
