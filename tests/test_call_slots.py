"""The per-tenant and server-wide concurrency slots shared by metric streams, uploads and serving
(ssdrbm_server.call_slots): which cap refuses, with whose subject, and that a waiting call gets
a slot as soon as one is given back. Over gRPC: test_datasets.py (uploads), test_fairness.py
(streams), test_serving_budgets.py (serving)."""

from __future__ import annotations

import asyncio

import pytest

from ssdrbm_server.call_slots import CallSlots, SlotCap
from ssdrbm_server.errors import ResourceExhaustedError

SERVER = SlotCap(3, "max_things", "the server has {count} things (limit {limit}); {fix}")
TENANT = SlotCap(2, "max_things_per_tenant", "tenant {tenant!r} has {count} (limit {limit})")


def test_a_tenant_at_its_share_leaves_the_others_room_until_the_server_is_full() -> None:
    totals: list[int] = []
    slots = CallSlots(SERVER, TENANT, on_change=totals.append)
    with slots.hold("a", fix="wait"), slots.hold("a", fix="wait"):
        with pytest.raises(ResourceExhaustedError) as mine, slots.hold("a", fix="wait"):
            pass
        assert mine.value.message == "tenant 'a' has 2 (limit 2)"
        assert mine.value.subject == "tenant:a" and mine.value.limit == "max_things_per_tenant"
        with slots.hold("b", fix="wait"):
            with pytest.raises(ResourceExhaustedError) as full, slots.hold("c", fix="wait"):
                pass
            assert full.value.message == "the server has 3 things (limit 3); wait"
            assert full.value.subject == "server" and full.value.limit == "max_things"
    assert slots.in_progress == 0 and slots.held_by("a") == 0
    assert totals == [1, 2, 3, 2, 1, 0]


def test_a_waiting_call_takes_the_first_slot_given_back_or_is_refused_after_its_wait() -> None:
    async def scenario() -> None:
        slots = CallSlots(None, SlotCap(1, "max_calls", "{count} computing; none in {wait_s} s"))
        finished = asyncio.Event()

        async def first() -> None:
            async with slots.hold_waiting("a", 0):
                await finished.wait()

        holder = asyncio.create_task(first())
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhaustedError, match=r"1 computing; none in 0\.05 s"):
            async with slots.hold_waiting("a", 0.05):
                pass
        asyncio.get_running_loop().call_later(0.05, finished.set)
        async with slots.hold_waiting("a", 30):  # a bound, not a speed check
            assert slots.held_by("a") == 1 and holder.done()
        async with slots.hold_waiting("b", 0):  # another tenant never waited
            pass

    asyncio.run(scenario())
