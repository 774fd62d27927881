"""The service case's upload phase: how long Redis is blocked for other clients, and how much
memory the API process takes, while a large dataset is uploaded through UploadDataset.

Uploads are stored in chunks of at most `SSDRBM_DATASET_CHUNK_BYTES` written as they arrive
(server/ssdrbm_server/store/datasets.py), so no single Redis command should hold Redis for long and
the API should never hold the whole array. Before chunking, one 512 MiB upload blocked Redis for
about 4.5 s, and the API process used 5.7 GB of memory for 1 GiB uploaded.

Per size: a second client (`bench.redis_ping`, its own process) PINGs Redis in a tight loop,
first while nothing is uploaded (the machine's own stalls, for comparison), then during the
upload; its longest gap between two answers is the figure. The API process's resident memory is
sampled every 50 ms meanwhile. Each dataset is deleted after its measurement.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from ssdrbm.datasets import upload_messages
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from bench.data import REPO_ROOT
from bench.redis_ping import READY
from bench.report import Case
from bench.service_process import MemorySampler, ServerProcess
from bench.timing import rss_mib
from ssdrbm_server.config import Settings

logger = logging.getLogger(__name__)

WIDTH = 1024  # uint8 columns: a MiB is 1024 rows
UPLOAD_TIMEOUT_S = 600.0
PING_START_TIMEOUT_S = 30.0
OLD_FIGURES = "before chunked storage: one 512 MiB upload blocked Redis about 4.5 s; the API used 5.7 GB for 1 GiB uploaded"  # noqa: E501


@dataclass(frozen=True)
class UploadPlan:
    sizes_mib: tuple[int, ...]
    idle_seconds: float  # PINGs with no upload running, before each upload

    @classmethod
    def full(cls) -> UploadPlan:
        return cls(sizes_mib=(256, 512), idle_seconds=2.0)

    @classmethod
    def quick(cls) -> UploadPlan:
        return cls(sizes_mib=(8,), idle_seconds=0.2)


@contextlib.contextmanager
def redis_pinger(redis_url: str) -> Iterator[dict[str, float]]:
    """PING Redis from another process for the duration of the block; the dict it yields is
    filled on exit with `pings` and `max_gap_ms`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.redis_ping", redis_url],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    result: dict[str, float] = {}
    try:
        _wait_ready(process)
        yield result
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=PING_START_TIMEOUT_S)
    result.update(json.loads(output.strip().splitlines()[-1]))


def _wait_ready(process: subprocess.Popen) -> None:
    # Its first line says the first PING answered; a dead process gives an empty line.
    line = process.stdout.readline().strip()
    if line != READY:
        raise RuntimeError(f"bench.redis_ping did not start: {line!r}")


def dataset(size_mib: int, seed: int = 0) -> np.ndarray:
    """`size_mib` MiB of binary uint8 data, WIDTH columns (content differs per seed and size)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2, size=(size_mib * 1024 * 1024 // WIDTH, WIDTH), dtype=np.uint8)


def measure_upload(
    stub: rbm_pb2_grpc.RBMServiceStub, server: ServerProcess, redis_url: str, size_mib: int,
    idle_seconds: float,
) -> dict[str, float]:  # fmt: skip
    """Upload `size_mib` MiB once while Redis is PINGed; the figures of that upload."""
    array = dataset(size_mib, seed=size_mib)
    with redis_pinger(redis_url) as idle:
        time.sleep(idle_seconds)
    rss_before = rss_mib(server.pid)
    with redis_pinger(redis_url) as busy, MemorySampler(server) as memory:
        started = time.perf_counter()
        reply = stub.UploadDataset(upload_messages(array, name=f"upload-{size_mib}"),
                                   timeout=UPLOAD_TIMEOUT_S)  # fmt: skip
        seconds = time.perf_counter() - started
    if reply.size_bytes != array.nbytes:
        raise RuntimeError(f"stored {reply.size_bytes} bytes of {array.nbytes}")
    stub.DeleteDataset(pb.DeleteDatasetRequest(dataset_id=reply.dataset_id), timeout=60)
    peak = max(memory.server_mib, default=None)
    return {
        "upload_s": seconds,
        "mib_per_s": size_mib / seconds,
        "redis_max_gap_ms": busy["max_gap_ms"],
        "redis_idle_max_gap_ms": idle["max_gap_ms"],
        "pings": busy["pings"],
        "api_rss_before_mib": rss_before,
        "api_peak_rss_mib": peak,
        "api_rss_growth_mib": None if peak is None or rss_before is None else peak - rss_before,
    }


def upload_cases(
    stub: rbm_pb2_grpc.RBMServiceStub, server: ServerProcess, redis_url: str, *, quick: bool
) -> list[Case]:
    """One Case per upload size of the plan."""
    plan = UploadPlan.quick() if quick else UploadPlan.full()
    chunk_bytes = Settings.from_env().dataset_chunk_bytes  # what the service process reads
    cases = []
    for size_mib in plan.sizes_mib:
        logger.info("service: uploading %d MiB while Redis is PINGed", size_mib)
        metrics = measure_upload(stub, server, redis_url, size_mib, plan.idle_seconds)
        config = {"size_mib": size_mib, "dtype": "uint8", "width": WIDTH,
                  "store_chunk_bytes": chunk_bytes, "redis": "AOF everysec"}  # fmt: skip
        cases.append(Case("service", f"dataset upload {size_mib} MiB", config, metrics,
                          notes=[f"dataset upload: {OLD_FIGURES}"]))  # fmt: skip
    return cases
