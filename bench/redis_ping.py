"""`python -m bench.redis_ping URL`: PING Redis in a tight loop until SIGTERM; how long it stalled.

A client of its own, in a process of its own, so that what it measures is Redis (and the
machine's scheduler), not the interpreter of whoever drives the load: it prints `READY` once the
first PING answered, then, after SIGTERM, one JSON line with the number of PINGs and the longest
gap between two consecutive answers (a command that holds Redis's single thread shows up there).
"""

from __future__ import annotations

import json
import signal
import sys
import time

import redis

READY = "READY"


def ping_until_stopped(client: redis.Redis, stopped: list[bool]) -> dict[str, float]:
    """PING until `stopped[0]`; the count and the longest gap between answers, in ms."""
    last = time.perf_counter()
    longest = 0.0
    pings = 0
    while not stopped[0]:
        client.ping()
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        pings += 1
    return {"pings": pings, "max_gap_ms": 1000.0 * longest}


def main(argv: list[str]) -> int:
    client = redis.Redis.from_url(argv[0], socket_timeout=60)
    stopped = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopped.__setitem__(0, True))
    client.ping()
    print(READY, flush=True)
    print(json.dumps(ping_until_stopped(client, stopped)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
