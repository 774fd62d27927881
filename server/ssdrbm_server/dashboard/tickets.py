"""Stream tickets: how a browser's EventSource, which cannot send an ``Authorization`` header,
proves who it is without the bearer token ever appearing in a URL.

The page asks for a ticket with its token (``POST .../ticket``) and opens the event stream with
it in the query string. A ticket is random (256 bits), names one tenant and one job, is good for
one stream and for ``TICKET_TTL_S`` seconds only, so a URL that a log or a browser history keeps
is worthless by the time anyone reads it. Tickets live in the issuing API process's memory (at
most ``MAX_TICKETS``): several API processes behind one address need sticky sessions for the
dashboard, or one process serving it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from ssdrbm_server.errors import ResourceExhaustedError, UnauthenticatedError
from ssdrbm_server.http_front import DASHBOARD_PATH

TICKET_TTL_S = 30.0
MAX_TICKETS = 1024  # outstanding in one process; a page holds one for well under a second


@dataclass(frozen=True)
class Ticket:
    tenant: str
    job_id: str
    expires_at: float


class StreamTickets:
    """Single-use, short-lived tickets for a tenant's event stream of one job."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tickets: dict[str, Ticket] = {}

    def issue(self, tenant: str, job_id: str) -> str:
        """A new ticket for ``tenant`` to follow ``job_id`` (the caller checked both)."""
        now = self._clock()
        self._tickets = {k: t for k, t in self._tickets.items() if t.expires_at > now}
        if len(self._tickets) >= MAX_TICKETS:
            raise ResourceExhaustedError(
                f"this server already holds {MAX_TICKETS} unused stream tickets; retry in "
                f"{TICKET_TTL_S:.0f} seconds",
                retry_after_s=TICKET_TTL_S,
            )
        ticket = secrets.token_urlsafe(32)
        self._tickets[ticket] = Ticket(tenant, job_id, now + TICKET_TTL_S)
        return ticket

    def redeem(self, ticket: str, job_id: str) -> str:
        """The tenant of ``ticket``, which is spent; UnauthenticatedError when it is unknown,
        spent, expired, or for another job."""
        found = self._tickets.pop(ticket, None)
        if found is None or found.expires_at <= self._clock() or found.job_id != job_id:
            raise UnauthenticatedError(
                "unknown, used or expired stream ticket: ask for a new one with POST "
                f"{DASHBOARD_PATH}/api/jobs/{job_id}/ticket (bearer token), and use it within "
                f"{TICKET_TTL_S:.0f} seconds",
                reason="INVALID_TICKET",
            )
        return found.tenant
