"""Timing and memory primitives: warm-up, repeated rounds, medians, percentiles, peak memory.

Shared machines drift by 2–3x within minutes, so the functions here are built for comparisons
measured side by side: `interleaved_rounds` runs every variant of one configuration in turn, round
after round, so that noise hits all of them alike and their ratios stay meaningful.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds per call over repeated rounds, after warm-up."""

    samples_s: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return 1000.0 * statistics.median(self.samples_s)

    @property
    def min_ms(self) -> float:
        return 1000.0 * min(self.samples_s)

    def as_dict(self) -> dict[str, float]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "rounds": len(self.samples_s),
        }


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings include it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], *, calls: int, device: torch.device) -> float:
    """Seconds per call of `fn`, averaged over `calls` back-to-back calls."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def interleaved_rounds(
    variants: Mapping[str, Callable[[], object]],
    *,
    warmup_calls: int,
    calls_per_round: int,
    rounds: int,
    device: torch.device,
    units_per_call: Mapping[str, int] | int = 1,
) -> dict[str, Timing]:
    """Time every variant round-robin: warm each up, then `rounds` rounds of all variants.

    Each round times `calls_per_round` consecutive calls of one variant and records the mean time
    per unit (a call may run `units_per_call` iterations); the result per variant is the list of
    per-round means (take the median). The order of variants is rotated from round to round so no
    variant always runs right after the same neighbour.
    """
    names = list(variants)
    for name in names:
        for _ in range(warmup_calls):
            variants[name]()
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = time_calls(variants[name], calls=calls_per_round, device=device)
            units = units_per_call if isinstance(units_per_call, int) else units_per_call[name]
            samples[name].append(seconds / units)
    return {name: Timing(tuple(values)) for name, values in samples.items()}


def paired_ratio(numerator: Timing, denominator: Timing) -> float:
    """Median over rounds of numerator / denominator, pairing samples taken in the same round.

    Both timings must come from one `interleaved_rounds` call. Load that drifts from round to
    round slows both members of a pair alike, so the paired ratio is steadier than the ratio of
    the two medians.
    """
    if len(numerator.samples_s) != len(denominator.samples_s):
        raise ValueError("paired_ratio needs timings from the same rounds")
    pairs = zip(numerator.samples_s, denominator.samples_s, strict=True)
    return statistics.median(top / bottom for top, bottom in pairs)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile (0..1) of `values` by linear interpolation between ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    weight = position - lower
    return ordered[lower] * (1.0 - weight) + ordered[upper] * weight


def _status_kib(pid: int | str, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mib(pid: int | str = "self") -> float | None:
    """Resident memory of a process in MiB (Linux), or None where it cannot be read."""
    kib = _status_kib(pid, "VmRSS")
    return None if kib is None else kib / 1024.0


def peak_rss_mib(pid: int | str = "self") -> float | None:
    """Peak resident memory (VmHWM) of a process in MiB (Linux), or None."""
    kib = _status_kib(pid, "VmHWM")
    return None if kib is None else kib / 1024.0


class TensorMemory:
    """Peaks of tensor memory of named phases, in MiB above each phase's starting level.

    Use as a context manager and wrap each phase in `with memory.phase(name):`; `peaks` holds the
    results after exit. CPU: one torch.profiler session records torch's own allocation and free
    events, replayed afterwards in time order, so the figures are exact and independent of what
    the C allocator keeps cached (one session for many phases: starting a profiler costs about a
    second). CUDA: torch's peak-allocated counter, reset per phase.
    """

    _PREFIX = "bench-memory-phase-"

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: dict[str, float] = {}
        self._names: list[str] = []
        self._profiler: torch.profiler.profile | None = None

    def __enter__(self) -> TensorMemory:
        gc.collect()
        if self.device.type != "cuda":
            activities = [torch.profiler.ProfilerActivity.CPU]
            self._profiler = torch.profiler.profile(activities=activities, profile_memory=True)
            self._profiler.__enter__()
        return self

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak of the block under `name`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peaks[name] = (torch.cuda.max_memory_allocated(self.device) - base) / 2**20
            return
        self._names.append(name)
        with torch.profiler.record_function(f"{self._PREFIX}{len(self._names) - 1}"):
            yield

    def __exit__(self, *exc_info: object) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(*exc_info)
        events = self._profiler.profiler.kineto_results.events()
        windows = {}
        for event in events:
            if event.name().startswith(self._PREFIX):
                index = int(event.name()[len(self._PREFIX) :])
                windows[self._names[index]] = (event.start_ns(), event.end_ns())
        memory = sorted(
            ((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"),
            key=lambda item: item[0],
        )
        for name, (start, end) in windows.items():
            self.peaks[name] = _window_peak(memory, start, end) / 2**20


def _window_peak(memory: list[tuple[int, int]], start: int, end: int) -> int:
    """Highest level of allocated bytes within [start, end], above the level at `start`."""
    level = peak = 0
    for time_ns, nbytes in memory:
        if time_ns < start:
            continue
        if time_ns > end:
            break
        level += nbytes
        peak = max(peak, level)
    return peak


def peak_tensor_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak of tensor memory allocated while `fn` runs, above the level at its start, in MiB."""
    with TensorMemory(device) as memory, memory.phase("call"):
        fn()
    return memory.peaks["call"]


def set_threads(threads: int) -> None:
    """Use `threads` CPU threads everywhere: torch, numpy's BLAS (scikit-learn) and subprocesses.

    Every implementation then runs with the same parallelism, so their ratios compare like with
    like. On a shared, oversubscribed machine one thread is the steadier choice: OpenMP threads
    that spin-wait for a descheduled sibling can slow a step down several-fold.
    """
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    threadpool_limits(limits=threads)  # stays in force for the rest of the process
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the service's processes inherit these
    os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ["SSDRBM_TORCH_THREADS"] = str(threads)


def environment() -> dict[str, object]:
    """What the figures were measured on: versions, threads, device, load."""
    info: dict[str, object] = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
    }
    with contextlib.suppress(OSError):  # not every platform has a load average
        info["load_average_1m"] = os.getloadavg()[0]
    info.update(_source_version())
    return info


def _source_version() -> dict[str, object]:
    """The commit measured, and whether the measured packages differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted_changes": bool(git("status", "--porcelain", "ssdcore", "ssdrbm_server")),
        }
    except (OSError, subprocess.SubprocessError):
        return {}
