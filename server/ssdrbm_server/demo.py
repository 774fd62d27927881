"""``python -m ssdrbm_server.demo --target HOST:PORT``: one training job through the running
service.

A command-line program (its output is the report): submits a small SSD training job over gRPC,
follows its live metrics, then uses the trained model — SampleHidden for features, Reconstruct
for denoising, ExportModel for the safetensors file — and prints a summary. It uses only the
generated stubs, as any other service would. ``scripts/demo`` (``ssdrbm_server/demo_stack.py``)
starts Redis and the service first.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import uuid

import grpc
import numpy as np
from ssdrbm.tensors import from_tensor, to_tensor
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from ssdrbm_server.healthcheck import check
from ssdrbm_server.readiness import READINESS

HEALTH_WAIT_S = 60.0


def wait_until_serving(target: str, timeout_s: float = HEALTH_WAIT_S) -> None:
    """Block until the server is ready (its readiness health entry answers SERVING)."""
    deadline = time.monotonic() + timeout_s
    while not check(target, service=READINESS, timeout_s=2):
        if time.monotonic() > deadline:
            raise SystemExit(f"the service did not become healthy within {timeout_s:.0f} s")
        time.sleep(0.2)


def training_request(dataset: str, steps: int) -> pb.StartTrainingRequest:
    """A Bernoulli RBM trained with exact low-rank SSD on ``dataset``."""
    if dataset == "mnist":
        source = pb.BuiltinDataset(name="mnist", options={"limit": "2000"})
        n_hidden = 64
    else:
        source = pb.BuiltinDataset(
            name="synthetic", options={"n_visible": "64", "n_hidden": "12", "n_samples": "3000"}
        )
        n_hidden = 16
    return pb.StartTrainingRequest(
        name=f"demo-{dataset}",
        request_id=f"demo-{uuid.uuid4().hex}",
        model=pb.ModelSpec(kind=pb.MODEL_KIND_BERNOULLI, n_hidden=n_hidden),
        optimizer=pb.OptimizerSpec(
            kind=pb.OPTIMIZER_KIND_SSD, lr=0.005, method=pb.POLAR_METHOD_LOWRANK
        ),
        training=pb.TrainingSpec(cd_k=1, batch_size=100, steps=steps, seed=1, checkpoint_every=100),
        eval=pb.EvalSpec(every=max(steps // 10, 1)),
        dataset=pb.DatasetRef(builtin=source),
    )


def start_job(stub: rbm_pb2_grpc.RBMServiceStub, steps: int) -> pb.Job:
    """Submit on MNIST, or on synthetic data when this server has no MNIST files."""
    try:
        return stub.StartTraining(training_request("mnist", steps), timeout=30).job
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        print(f"MNIST is not installed on the server ({exc.details()}); using synthetic data")
        return stub.StartTraining(training_request("synthetic", steps), timeout=30).job


def follow(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> list[pb.Metrics]:
    """Print the job's events live until it ends; returns its metric events."""
    metrics: list[pb.Metrics] = []
    print(
        f"{'step':>6} {'recon err':>10} {'FE gap':>8} {'pseudo-LL':>10} {'||W||2':>7} {'samp/s':>8}"
    )
    for event in stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job_id), timeout=600):
        if event.WhichOneof("event") == "state":
            state = pb.JobState.Name(event.state.state).removeprefix("JOB_STATE_")
            suffix = f" ({event.state.message})" if event.state.message else ""
            print(f"-- {state}{suffix}")
            continue
        m = event.metrics
        metrics.append(m)
        print(
            f"{m.step:>6} {m.reconstruction_error:>10.3f} {m.free_energy_gap:>8.3f} "
            f"{m.pseudo_log_likelihood:>10.3f} {m.spectral_norm:>7.3f} "
            f"{m.samples_per_second:>10.0f}"
        )
    return metrics


def use_model(stub: rbm_pb2_grpc.RBMServiceStub, job: pb.Job) -> dict[str, object]:
    """Features, denoising and export against the trained model."""
    rng = np.random.default_rng(0)
    clean = (rng.random((8, job.n_visible)) < 0.2).astype(np.float32)
    features = stub.SampleHidden(
        pb.SampleHiddenRequest(job_id=job.id, input=to_tensor(clean)), timeout=30
    )
    noisy = np.where(rng.random(clean.shape) < 0.1, 1.0 - clean, clean).astype(np.float32)
    rebuilt = stub.Reconstruct(
        pb.ReconstructRequest(job_id=job.id, input=to_tensor(noisy), k=1, mean_field=True),
        timeout=30,
    )
    header, chunks = None, []
    for part in stub.ExportModel(pb.ExportModelRequest(job_id=job.id), timeout=60):
        if part.WhichOneof("part") == "header":
            header = part.header
        else:
            chunks.append(part.chunk)
    blob = b"".join(chunks)
    assert header is not None
    return {
        "features": from_tensor(features.output).shape,
        "reconstruction": from_tensor(rebuilt.output).shape,
        "checkpoint": rebuilt.checkpoint_step,
        "export_bytes": len(blob),
        "export_ok": hashlib.sha256(blob).hexdigest() == header.sha256,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the demo against ``--target``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m ssdrbm_server.demo", description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the service")
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    args = parser.parse_args(argv)
    wait_until_serving(args.target)
    with grpc.insecure_channel(args.target) as channel:
        stub = rbm_pb2_grpc.RBMServiceStub(channel)
        started = time.monotonic()
        job = start_job(stub, args.steps)
        print(f"job {job.id} queued: {job.name}, {job.total_steps} steps")
        metrics = follow(stub, job.id)
        job = stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=30)
        state = pb.JobState.Name(job.state).removeprefix("JOB_STATE_")
        if job.state != pb.JOB_STATE_SUCCEEDED:
            print(f"job ended {state}: {job.error}", file=sys.stderr)
            return 1
        used = use_model(stub, job)
        first, last = metrics[0], metrics[-1]
        print()
        print("summary")
        print(f"  job               {job.id} {state} in {time.monotonic() - started:.1f} s")
        print(f"  model             Bernoulli RBM {job.n_visible}x{job.spec.model.n_hidden}, SSD")
        print(
            f"  recon. error      {first.reconstruction_error:.3f} (step {first.step}) -> "
            f"{last.reconstruction_error:.3f} (step {last.step})"
        )
        print(f"  throughput        {last.samples_per_second:.0f} samples/s")
        print(f"  SampleHidden      features {used['features']}")
        print(f"  Reconstruct       {used['reconstruction']} from checkpoint {used['checkpoint']}")
        print(
            f"  ExportModel       {used['export_bytes']} bytes of safetensors, "
            f"sha256 {'verified' if used['export_ok'] else 'MISMATCH'}"
        )
        return 0 if used["export_ok"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
