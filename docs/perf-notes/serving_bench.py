"""Serving latency and throughput only: ``python docs/perf-notes/serving_bench.py [--repeats N]``.

The same measurements as ``python -m bench service`` (its own helpers: redis-server on a free
port, the service as a separate process, sequential calls, 16 concurrent clients), without the
StreamMetrics and training-throughput phases, so before/after runs can alternate quickly. The
served model is 784x500, trained for 20 steps (its size, not its quality, sets the cost).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

import grpc  # noqa: E402
from ssdrbm.v1 import rbm_pb2_grpc  # noqa: E402

from bench.service import (  # noqa: E402
    concurrent_load,
    redis_server,
    sequential_latency,
    service_process,
    training_request,
    wait_for_job,
)
from bench.timing import percentile  # noqa: E402


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
            channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
