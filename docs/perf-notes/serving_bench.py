"""Serving latency and throughput only: ``python docs/perf-notes/serving_bench.py [--repeats N]``.

The same measurements as ``python -m bench service`` (its own helpers: redis-server on a free
port, the service as a separate process, sequential calls, 16 concurrent clients), without the
StreamMetrics and training-throughput phases, so before/after runs can alternate quickly. The
served model is 784x500, trained for 20 steps (its size, not its quality, sets the cost). Like
the benchmark, the requests are seeded (seed 1); one more 16-client case sends unseeded
(seed 0) requests, which the server may join into one batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

import grpc
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from bench.service import (
    concurrent_load,
    cpu_seconds,
    sequential_latency,
    tensor,
    training_request,
    wait_for_job,
)
from bench.service_process import redis_server, service_process
from bench.timing import percentile, rss_mib


async def _unseeded(target: str, job_id: str, clients: int, seconds: float) -> list[float]:
    request = pb.ReconstructRequest(job_id=job_id, input=tensor(1), k=1, seed=0)
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(clients)
    ]
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client(stub: rbm_pb2_grpc.RBMServiceStub) -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await stub.Reconstruct(request, timeout=30)
            latencies.append(time.perf_counter() - start)

    stubs = [rbm_pb2_grpc.RBMServiceStub(channel) for channel in channels]
    await asyncio.gather(*(stub.Reconstruct(request, timeout=30) for stub in stubs))
    await asyncio.gather(*(client(stub) for stub in stubs))
    await asyncio.gather(*(channel.close() for channel in channels))
    return latencies


def unseeded_load(target: str, job_id: str, pid: int, seconds: float) -> dict[str, float]:
    """16 clients sending unseeded batch-1 Reconstruct requests; server CPU per request."""
    server_cpu, started = cpu_seconds(pid), time.perf_counter()
    latencies = asyncio.run(_unseeded(target, job_id, 16, seconds))
    elapsed = time.perf_counter() - started
    return {
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * percentile(latencies, 0.5),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "server_cpu_ms_per_request": 1000 * (cpu_seconds(pid) - server_cpu) / len(latencies),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="16-client load per repeat")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ssdrbm-serving-") as scratch:
        directory = Path(scratch)
        with redis_server(directory) as redis_url, service_process(redis_url, directory) as server:
            channel = grpc.insecure_channel(server.target)
            stub = rbm_pb2_grpc.RBMServiceStub(channel)
            request = training_request(
                n_hidden=500, steps=20, eval_every=20, name="served", images=1000
            )
            job = stub.StartTraining(request, timeout=30).job
            wait_for_job(stub, job.id)
            for repeat in range(args.repeats):
                for rpc in ("Reconstruct", "SampleHidden"):
                    for batch, count in ((1, 1000), (256, 100)):
                        samples = sequential_latency(stub, rpc, job.id, batch, count)
                        print(json.dumps({
                            "label": args.label, "repeat": repeat, "case": f"{rpc} batch {batch}",
                            "p50_ms": round(1000 * percentile(samples, 0.5), 3),
                            "p99_ms": round(1000 * percentile(samples, 0.99), 3),
                        }), flush=True)  # fmt: skip
                load = concurrent_load(
                    server.target, job.id, seconds=args.seconds, server_pid=server.pid
                )
                print(json.dumps({"label": args.label, "repeat": repeat,
                                  "case": "Reconstruct 16 clients",
                                  **{k: round(v, 3) for k, v in load.items()}}),
                      flush=True)  # fmt: skip
                load = unseeded_load(server.target, job.id, server.pid, args.seconds)
                load["server_rss_mib"] = rss_mib(server.pid)
                print(json.dumps({"label": args.label, "repeat": repeat,
                                  "case": "Reconstruct 16 clients, unseeded",
                                  **{k: round(v, 3) for k, v in load.items()}}),
                      flush=True)  # fmt: skip
            channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
