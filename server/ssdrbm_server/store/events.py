"""A job's event stream: metric events and state changes, in order, each with a resume token.

Entries of `job:{id}:metrics` carry `kind` (b"metrics" | b"state" | b"backoff"), `data` (a
serialized ssdrbm.v1.Metrics or StateChange; for a backoff, what the worker wrote), `time`
(Unix seconds) and `attempt`. The entry id ("<ms>-<seq>") is the resume token: reading after
it continues with no gap and no repeat. The writers (submit, cancel, claim, fenced writes) are
Lua scripts; this module builds their fields and XADD line, and reads.
"""

from __future__ import annotations

import re
import time

from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.errors import InvalidArgumentError
from ssdrbm_server.keys import Keys
from ssdrbm_server.store.connection import RedisClient, Store, text
from ssdrbm_server.store.records import JobState

METRICS = "metrics"
STATE = "state"
BACKOFF = "backoff"
EVENT_FIELDS = ("kind", "data", "time", "attempt")  # every entry has these, in this order

_TOKEN = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")  # ASCII digits only, as Redis reads them
_START = "0-0"
_MAX_ID_PART = 2**64 - 1  # both halves of a stream id are unsigned 64-bit
# A blocking read holds its connection and must end before the client's socket timeout
# (ssdrbm_server/store/connection.py); callers that follow longer simply read again.
MAX_BLOCK_MS = 5000


def _event_fields(kind: str, data: bytes, attempt: int) -> dict[str, bytes | str]:
    return {"kind": kind, "data": data, "time": repr(time.time()), "attempt": str(attempt)}


def state_event_fields(
    state: JobState, *, attempt: int, step: int, message: str = ""
) -> dict[str, bytes | str]:
    """Fields of a state-change entry."""
    change = rbm_pb2.StateChange(
        state=rbm_pb2.JobState.Value(f"JOB_STATE_{state.value}"),
        message=message,
        attempt=attempt,
        step=step,
    )
    return _event_fields(STATE, change.SerializeToString(), attempt)


def metrics_event_fields(metrics: bytes, *, attempt: int) -> dict[str, bytes | str]:
    """Fields of a metric entry; `metrics` is a serialized ssdrbm.v1.Metrics."""
    return _event_fields(METRICS, metrics, attempt)


def backoff_event_fields(data: bytes, *, attempt: int) -> dict[str, bytes | str]:
    """Fields of a backoff entry; `data`: the worker's description of why and to where."""
    return _event_fields(BACKOFF, data, attempt)


def event_values(fields: dict[str, bytes | str]) -> list[bytes | str]:
    """The values of an entry's fields in EVENT_FIELDS order, as `xadd_event` expects them."""
    return [fields[name] for name in EVENT_FIELDS]


def xadd_event(stream_key: str, first_arg: int) -> str:
    """Lua line appending an event to `stream_key` (a KEYS[...] expression) whose values are
    ARGV[first_arg] onwards, as `event_values` lists them."""
    pairs = ", ".join(
        f"'{name}', ARGV[{first_arg + offset}]" for offset, name in enumerate(EVENT_FIELDS)
    )
    return f"redis.call('XADD', {stream_key}, '*', {pairs})\n"


def check_token(after: str) -> str:
    """The stream id to read after; "" means from the beginning. Raises InvalidArgumentError."""
    if after == "":
        return _START
    if not _TOKEN.fullmatch(after) or any(int(part) > _MAX_ID_PART for part in after.split("-")):
        raise InvalidArgumentError(
            "after",
            f"{after[:40]!r} is not a resume token; pass the resume_token of an event you "
            "received, or leave it empty to start from the beginning",
        )
    return after


def token_order(token: str) -> tuple[int, int]:
    """Sort key of a checked resume token (time, then sequence; "" first)."""
    if not token:
        return (0, 0)
    millis, sequence = token.split("-", 1)
    return int(millis), int(sequence)


class EventStore(Store):
    """Reads a job's event stream (replay from a token, or follow it live)."""

    def __init__(
        self, redis: RedisClient, *, keys: Keys | None = None, blocking: RedisClient | None = None
    ) -> None:
        super().__init__(redis, keys=keys)
        # Blocking reads hold a connection for up to a second each: with their own pool (sized
        # to the stream limit) they cannot use up the connections of ordinary calls.
        self.blocking = blocking if blocking is not None else redis

    async def read(
        self, job_id: str, *, after: str, count: int, block_ms: int | None
    ) -> list[tuple[str, str, bytes]]:
        """Up to `count` events after the token `after`, as (token, kind, data), oldest first:
        at once (replay; block_ms=None), or waiting up to block_ms (at most MAX_BLOCK_MS) for a
        new event (live follow; [] on timeout)."""
        start = check_token(after)
        if count < 1:
            raise InvalidArgumentError("count", "must be at least 1")
        block = min(block_ms, MAX_BLOCK_MS) if block_ms and block_ms > 0 else None
        client = self.blocking if block is not None else self.redis
        reply = await client.xread({self.keys.events(job_id): start}, count=count, block=block)
        return [
            (text(entry_id), fields[b"kind"].decode(), fields[b"data"])
            for _stream, entries in reply or []
            for entry_id, fields in entries
        ]

    async def last_token(self, job_id: str) -> str:
        """Token of the newest event, "" if the stream is empty."""
        newest = await self.redis.xrevrange(self.keys.events(job_id), count=1)
        return text(newest[0][0]) if newest else ""
