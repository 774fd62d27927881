"""Slots: how many training processes one worker runs at once, and each one's share of CPUs.

Each slot of a worker (worker/worker.py) is a worker of its own to the queue and the leases: its
own id (``<worker id>/<k>``; a worker of one slot keeps its plain id), claims, leases, time
slices, training process and graceful stop, all by the one Worker/Runner path.

The default (SSDRBM_WORKER_SLOTS=0, `default_slot_count`) comes from the machine:

- *CPUs.* The usable CPUs (affinity mask or SSDRBM_TRAINING_CPUS, fewer under a cgroup CPU
  quota) ÷ the torch threads of one process: SSDRBM_TORCH_THREADS, else THREADS_PER_PROCESS
  (1): jobs on separate cores do not wait on each other, a small job's step gains little from
  more threads, and a busy worker's threads would otherwise oversubscribe the cores (2 OpenMP
  threads per process on an oversubscribed host made a step 7–8× slower, docs/PERFORMANCE.md).
- *Memory.* Each slot may train a full pack (PROCESS_BASE_MB + SSDRBM_PACK_MEMORY_MB): slots
  stop where the memory this process may use (host or cgroup limit) holds no more, so adding
  slots never needs a bigger machine than packing does.
- *The event loop.* Every slot's supervision runs in the one event loop (in ``ssdrbm serve``,
  the gRPC calls' too): the fastest jobs (16×8 models, 1,000–2,400 steps/s) took 1–2% of a
  core per busy slot at the default evaluation spacing and 5% reporting every 10 steps, so at
  MAX_DEFAULT_SLOTS (16) 16–32% of one core; more slots only when set.
- *GPU.* One slot where a GPU is present (found without importing torch): the processes would
  share one busy device. Set SSDRBM_WORKER_SLOTS to share it anyway.

The slots split the training CPUs into consecutive shares (cpus.py ``split_cpus``), each
slot's processes pinned to its share with as many torch threads unless SSDRBM_TORCH_THREADS
says otherwise; a worker of one slot pins to SSDRBM_TRAINING_CPUS, with torch's default threads.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from ssdrbm_server.config import Settings
from ssdrbm_server.cpus import format_cpu_list, process_cpus, split_cpus
from ssdrbm_server.worker.runner import PROCESS_BASE_MB

THREADS_PER_PROCESS = 1  # torch threads of a training process the default counts with
MAX_DEFAULT_SLOTS = 16
CGROUP_ROOT = Path("/sys/fs/cgroup")
MB = 1024 * 1024


@dataclass(frozen=True)
class Machine:
    """What the default slot count is derived from."""

    cpus: frozenset[int]  # the CPUs training may use: SSDRBM_TRAINING_CPUS or the affinity mask
    cpu_quota: float | None  # CPUs' worth of time the cgroup allows; None: no quota
    memory_mb: int | None  # memory this process may use (host or cgroup limit); None: unknown
    gpu: bool  # a CUDA device is present

    @property
    def usable_cpus(self) -> int:
        """CPUs' worth of compute: the CPUs, or fewer under a quota (at least 1)."""
        count = len(self.cpus)
        if self.cpu_quota is not None:
            count = min(count, int(self.cpu_quota))
        return max(1, count)


def default_slot_count(machine: Machine, *, threads_per_process: int, slot_memory_mb: int) -> int:
    """The slots a worker runs unless told: see the module's docstring."""
    if machine.gpu:
        return 1
    by_cpus = machine.usable_cpus // max(1, threads_per_process)
    count = min(by_cpus, MAX_DEFAULT_SLOTS)
    if machine.memory_mb is not None:
        count = min(count, machine.memory_mb // max(1, slot_memory_mb))
    return max(1, count)


def slot_count(settings: Settings, machine: Machine | None = None) -> int:
    """SSDRBM_WORKER_SLOTS, or the default for this machine when it is 0."""
    if settings.worker_slots:
        return settings.worker_slots
    return default_slot_count(
        machine or this_machine(settings),
        threads_per_process=settings.torch_threads or THREADS_PER_PROCESS,
        slot_memory_mb=PROCESS_BASE_MB + settings.pack_memory_mb,
    )


def slot_settings(
    settings: Settings, worker_id: str, machine: Machine | None = None
) -> list[Settings]:
    """Each slot's settings: the worker's, with the slot's id, training CPUs and torch threads."""
    machine = machine or this_machine(settings)
    count = slot_count(settings, machine)
    if count == 1:
        return [settings.replace(worker_id=worker_id)]
    threads = settings.torch_threads or max(1, machine.usable_cpus // count)
    return [
        settings.replace(
            worker_id=f"{worker_id}/{k}",
            training_cpus=format_cpu_list(share),
            torch_threads=threads,
        )
        for k, share in enumerate(split_cpus(machine.cpus, count))
    ]


def this_machine(settings: Settings) -> Machine:
    """The machine this process runs on, as the slot count sees it."""
    return Machine(
        cpus=settings.training_cpu_set or process_cpus(),
        cpu_quota=cgroup_cpu_quota(),
        memory_mb=memory_mb(),
        gpu=has_gpu(),
    )


def _own_cgroup() -> Path:
    """This process's cgroup (v2) directory; the root in a container with its own namespace."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return CGROUP_ROOT / line[3:].lstrip("/")
    except OSError:
        pass
    return CGROUP_ROOT


def _cgroup_value(name: str) -> str | None:
    try:
        return (_own_cgroup() / name).read_text().strip()
    except OSError:
        return None


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time this process's cgroup may use (``cpu.max``: quota ÷ period; a
    container's CPU limit, while its affinity mask names every CPU); None without a quota."""
    value = _cgroup_value("cpu.max")
    if value is None:
        return None
    quota, _, period = value.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def memory_mb() -> int | None:
    """Memory this process may use, in MB: the host's, or less under a cgroup limit; None
    when neither can be read."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 0
    limit = _cgroup_value("memory.max")
    if limit is not None and limit.isdigit():
        total = min(total, int(limit)) if total else int(limit)
    return total // MB if total else None


def has_gpu() -> bool:
    """Whether a CUDA device is present, without importing torch (the worker never does): an
    NVIDIA device node (or ROCm's /dev/kfd), unless CUDA_VISIBLE_DEVICES hides every device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")
