"""Calls of one kind in progress in this API process, capped for the server and for each tenant.

The server's cap bounds what the calls cost together (memory, Redis connections); a tenant's cap,
below it, is its share, so one tenant's slow calls cannot refuse the others'. A call over either
cap is refused at once (RESOURCE_EXHAUSTED, retry shortly) naming the cap and its setting, with a
QuotaFailure saying whose cap it was (`tenant:<t>` or `server`); serving's calls, whose only
server bound is its thread pool, wait a little for a slot instead (`hold_waiting`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from ssdrbm_server.errors import (
    RETRY_SHORTLY_S,
    SERVER_SUBJECT,
    ResourceExhaustedError,
    tenant_subject,
)


@dataclass(frozen=True)
class SlotCap:
    """One cap: its value, the Settings field it comes from (named by the refusal's ErrorInfo),
    and the refusal's message, a format string of ``{count}`` (calls in progress), ``{limit}``,
    ``{tenant}`` and the fields the caller passes to ``hold``."""

    limit: int
    setting: str
    message: str


class CallSlots:
    """Counts the calls in progress; ``hold`` takes a slot for the length of a call."""

    def __init__(
        self,
        server: SlotCap | None,
        tenant: SlotCap,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        self.server = server  # None: no cap for the whole server
        self.tenant = tenant
        self._on_change = on_change  # told the new total (a Prometheus gauge)
        self._total = 0
        self._by_tenant: Counter[str] = Counter()
        self._freed = asyncio.Event()  # set, and replaced, whenever a slot is given back

    @property
    def in_progress(self) -> int:
        return self._total

    def held_by(self, tenant: str) -> int:
        return self._by_tenant[tenant]

    @contextlib.contextmanager
    def hold(self, tenant: str, **fields: str) -> Iterator[None]:
        """A slot for ``tenant`` while the block runs; ResourceExhaustedError when the server
        or the tenant is at its cap (``fields`` fill the message)."""
        refusal = self._refusal_for(tenant, fields)
        if refusal is not None:
            raise refusal
        with self._held(tenant):
            yield

    @contextlib.asynccontextmanager
    async def hold_waiting(self, tenant: str, wait_s: float, **fields: str) -> AsyncIterator[None]:
        """As ``hold``, but a call over a cap first waits up to ``wait_s`` seconds for a slot
        (the message may use ``{wait_s}``)."""
        deadline = time.monotonic() + max(wait_s, 0.0)
        fields = {**fields, "wait_s": f"{wait_s:.2f}"}
        while (refusal := self._refusal_for(tenant, fields)) is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise refusal
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)
        with self._held(tenant):
            yield

    def _refusal_for(self, tenant: str, fields: dict[str, str]) -> ResourceExhaustedError | None:
        # The server's cap first: when both are full, the tenant's share is not what to fix.
        if self.server is not None and self._total >= self.server.limit:
            return self._refusal(self.server, self._total, tenant, fields, subject=SERVER_SUBJECT)
        held = self._by_tenant[tenant]
        if held >= self.tenant.limit:
            return self._refusal(self.tenant, held, tenant, fields, subject=tenant_subject(tenant))
        return None

    @contextlib.contextmanager
    def _held(self, tenant: str) -> Iterator[None]:
        self._add(tenant, +1)
        try:
            yield
        finally:
            self._add(tenant, -1)
            self._freed.set()  # wakes the calls waiting for a slot
            self._freed = asyncio.Event()

    @staticmethod
    def _refusal(
        cap: SlotCap, count: int, tenant: str, fields: dict[str, str], *, subject: str
    ) -> ResourceExhaustedError:
        message = cap.message.format(count=count, limit=cap.limit, tenant=tenant, **fields)
        return ResourceExhaustedError(
            message, limit=cap.setting, subject=subject, retry_after_s=RETRY_SHORTLY_S
        )

    def _add(self, tenant: str, delta: int) -> None:
        self._total += delta
        self._by_tenant[tenant] += delta
        if not self._by_tenant[tenant]:
            del self._by_tenant[tenant]  # idle tenants cost nothing
        if self._on_change is not None:
            self._on_change(self._total)
