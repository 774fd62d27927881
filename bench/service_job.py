"""A training job through the service next to the same training in the library, one run.

`python -m bench.service_job [--quick] [--json]` starts its own redis-server and the service
(gRPC server + worker, `bench.service_host`), submits the core benchmark's headline job — a
784×500 Bernoulli RBM on MNIST, CD-10, batch 100, SSD with the polar method left unset — and
reads back what the worker chose for its device (`Job.runtime`, e.g. newton-schulz with CUDA
graphs on a GPU) and its training time per step. The library then trains the same
configuration in this process with ``method="auto"``, on the same device. On a GPU machine
`scripts/gpu-check` runs it: the service's step time belongs next to the library's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

import ssdcore
from bench.service import wait_for_job
from bench.service_process import redis_server, service_process
from ssdcore.data import default_data_dir, load_mnist, preprocess
from ssdcore.optim import OptimizerConfig

logger = logging.getLogger(__name__)

N_VISIBLE, N_HIDDEN, CD_K, BATCH = 784, 500, 10, 100
LR = 1e-3  # a stable SSD step at this size; the figure is time, not quality


@dataclass(frozen=True)
class Comparison:
    """Milliseconds per training step, through the service and in the library."""

    device: str
    runtime: str  # the service job's Job.runtime.summary
    steps: int
    service_ms_per_step: float
    library_ms_per_step: float

    @property
    def ratio(self) -> float:
        return self.service_ms_per_step / self.library_ms_per_step


def request(steps: int, n_hidden: int, images: int) -> pb.StartTrainingRequest:
    """The headline job, polar method unset: the worker picks it for its device."""
    return pb.StartTrainingRequest(
        name="service-job-bench",
        model=pb.ModelSpec(n_hidden=n_hidden),
        optimizer=pb.OptimizerSpec(kind=pb.OPTIMIZER_KIND_SSD, lr=LR),
        training=pb.TrainingSpec(
            cd_k=CD_K, batch_size=BATCH, steps=steps, seed=1, checkpoint_every=steps
        ),
        eval=pb.EvalSpec(every=steps),
        dataset=pb.DatasetRef(
            builtin=pb.BuiltinDataset(name="mnist", options={"limit": str(images)})
        ),
    )


def service_ms_per_step(steps: int, n_hidden: int, images: int) -> tuple[float, str]:
    """(training ms per step as the worker reports it, the job's runtime summary)."""
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        with redis_server(directory) as url, service_process(url, directory) as server:
            channel = grpc.insecure_channel(server.target)
            stub = rbm_pb2_grpc.RBMServiceStub(channel)
            job = stub.StartTraining(request(steps, n_hidden, images), timeout=30).job
            done = wait_for_job(stub, job.id)
            channel.close()
    # wall_time_s is the trainer's own training time (evaluation and I/O excluded).
    return 1000 * done.latest_metrics.wall_time_s / steps, done.runtime.summary


def library_ms_per_step(steps: int, n_hidden: int, images: int) -> float:
    """The same training in this process, through ssdcore.Trainer."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = preprocess(load_mnist(default_data_dir() / "mnist")[:images], "binarize").to(device)
    model = ssdcore.BernoulliRBM(N_VISIBLE, n_hidden).to(device)
    trainer = ssdcore.Trainer(
        model, data, optimizer=OptimizerConfig("ssd", lr=LR), batch_size=BATCH, cd_k=CD_K
    )
    trainer.train_steps(min(20, steps))  # warm-up (and graph capture on a GPU)
    start = time.perf_counter()
    trainer.train_steps(steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / steps


def run(*, quick: bool = False) -> Comparison:
    steps, n_hidden, images = (20, 50, 500) if quick else (1000, N_HIDDEN, 10_000)
    service_ms, runtime = service_ms_per_step(steps, n_hidden, images)
    library_ms = library_ms_per_step(steps, n_hidden, images)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return Comparison(device, runtime, steps, service_ms, library_ms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service_job", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="50 hidden units, 20 steps")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(quick=args.quick)
    if args.json:
        print(json.dumps({**asdict(result), "ratio": result.ratio}))
    else:
        print(
            f"{result.device}: {result.steps} steps, CD-{CD_K}, batch {BATCH}, SSD (method unset)\n"
            f"  service job  {result.service_ms_per_step:8.3f} ms/step  ({result.runtime})\n"
            f"  library      {result.library_ms_per_step:8.3f} ms/step\n"
            f"  service / library  {result.ratio:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
