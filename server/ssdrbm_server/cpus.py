"""CPU sets that keep training and serving off each other's cores on a shared host.

`SSDRBM_SERVING_CPUS` pins the API server process, `SSDRBM_TRAINING_CPUS` every worker's
training process, in the Linux CPU-list syntax (`0-3,8`); empty (the default) pins nothing. A
training step is one long run of matrix products, a serving call is latency bound: on the same
cores a burst of serving slows training and a training step delays replies. Disjoint sets trade
that contention for a fixed split of the machine. A worker with several slots splits its
training CPUs into one share per slot (worker/slots.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterable

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU numbers of a list such as ``"0-3,8"``; empty text is the empty set (no pinning).

    Raises ValueError, naming the part that is wrong, for anything else.
    """
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or part.endswith("-"):
            raise ValueError(f"{part!r} is not a CPU number or range (write e.g. 0-3,8)")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"range {part!r} runs backwards (write {high}-{low})")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The CPU-list text of ``cpus``, as parse_cpu_list reads it: ``{0, 1, 2, 3, 8}`` is "0-3,8"."""
    parts = []
    # Consecutive CPUs share their difference from their index in the sorted list.
    for _, group in itertools.groupby(enumerate(sorted(set(cpus))), lambda item: item[1] - item[0]):
        run = [cpu for _, cpu in group]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def split_cpus(cpus: Iterable[int], parts: int) -> list[frozenset[int]]:
    """``cpus`` cut into ``parts`` shares of consecutive CPUs, sizes differing by one at most.

    Consecutive numbers: Linux numbers the cores of one socket (NUMA node) together, so a share
    stays on one node where it can. With fewer CPUs than parts no share is fixed: every part
    gets them all, and the scheduler balances the processes over them.
    """
    ordered = sorted(set(cpus))
    if len(ordered) < parts:
        return [frozenset(ordered)] * parts
    size, extra = divmod(len(ordered), parts)
    edges = [0, *itertools.accumulate(size + (part < extra) for part in range(parts))]
    return [frozenset(ordered[start:end]) for start, end in itertools.pairwise(edges)]


def process_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def beyond_host(cpus: Iterable[int]) -> list[int]:
    """The CPUs of ``cpus`` past this host's count (the host's CPUs are 0 … count - 1).

    Checked against the count, not this process's own mask: a server pinned to its serving
    CPUs still starts training processes on the others.
    """
    count = os.cpu_count() or 1
    return sorted(cpu for cpu in cpus if cpu >= count)


def _thread_ids() -> list[int]:
    """This process's threads (Linux), or just "the calling thread" where /proc is missing."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin_this_process(cpus: Iterable[int], what: str) -> None:
    """Restrict this process, every thread it has now, to ``cpus`` (no-op for an empty set).

    Linux applies a mask per thread: threads started later inherit the mask of the thread
    that starts them, but threads that exist already (numpy's BLAS pool starts at import)
    must each be set, which is done here.
    """
    chosen = frozenset(cpus)
    if not chosen:
        return
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("%s CPUs %s requested, but this platform cannot pin processes", what, chosen)
        return
    try:
        for thread in _thread_ids():
            with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
                os.sched_setaffinity(thread, chosen)
    except OSError as exc:  # e.g. CPUs outside this container's cpuset: run, but say so
        logger.error("%s process could not be pinned to CPUs %s: %s", what, sorted(chosen), exc)
        return
    logger.info("%s process %d pinned to CPUs %s", what, os.getpid(), sorted(chosen))
