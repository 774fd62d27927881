"""The worker's training process as the worker runs it: a job over its pipe, on the device the
process finds (CUDA when present).

No Redis is involved: the test plays the worker's side of the pipe protocol
(server/ssdrbm_server/worker/protocol.py), so it runs wherever the CUDA tests run. The CPU case runs
everywhere: an unset polar method reaches a CPU worker as lowrank and a CUDA one as
Newton–Schulz, and the STARTED message says so (the runner records it in the job).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import threading

import pytest
import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore.checkpoint import model_from_bytes
from ssdrbm_server.config import Settings
from ssdrbm_server.resolver import resolve
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.child import train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def start_message(tmp_path, optimizer: rbm_pb2.OptimizerSpec) -> protocol.Message:
    request = rbm_pb2.StartTrainingRequest(
        model=rbm_pb2.ModelSpec(kind=rbm_pb2.MODEL_KIND_BERNOULLI, n_hidden=12),
        optimizer=optimizer,
        training=rbm_pb2.TrainingSpec(epochs=2, batch_size=50, seed=3, checkpoint_every=20),
        eval=rbm_pb2.EvalSpec(every=10),
        dataset=rbm_pb2.DatasetRef(
            builtin=rbm_pb2.BuiltinDataset(name="synthetic", options={"n_samples": "1000"})
        ),
    )
    settings = Settings(data_dir=str(tmp_path))
    job = asyncio.run(resolve(request, settings, find_upload=None))
    fields = {
        "settings": dataclasses.asdict(settings),
        "backoffs": 0,
        "total_steps": job.total_steps,
        "n_visible": job.n_visible,
    }
    return protocol.Message(protocol.START, fields, {"spec": job.spec.SerializeToString()})


def run_job(tmp_path, optimizer: rbm_pb2.OptimizerSpec) -> list[protocol.Message]:
    worker_end, child_end = multiprocessing.Pipe()
    thread = threading.Thread(target=train, args=(child_end, start_message(tmp_path, optimizer)))
    thread.start()
    messages = []
    while not messages or messages[-1].kind not in (protocol.FINISHED, protocol.FAILED):
        message = protocol.receive(worker_end)
        if message.kind != protocol.ALIVE:  # heartbeats are the worker's concern, not ours
            messages.append(message)
    thread.join(timeout=60)
    return messages


def test_an_unset_polar_method_runs_as_the_device_s_automatic_choice(tmp_path):
    messages = run_job(tmp_path, rbm_pb2.OptimizerSpec(kind=rbm_pb2.OPTIMIZER_KIND_SSD))
    assert messages[-1].kind == protocol.FINISHED, messages[-1].fields
    runtime = json.loads(messages[0].fields["runtime"])
    if torch.cuda.is_available():
        assert runtime["device"].startswith("cuda")
        assert runtime["method"] == "POLAR_METHOD_NEWTON_SCHULZ"
        assert "newton-schulz (auto on cuda)" in runtime["summary"]
    else:
        assert runtime["device"] == "cpu"
        assert runtime["method"] == "POLAR_METHOD_LOWRANK"
        assert "lowrank (auto on cpu)" in runtime["summary"]


@needs_cuda
@pytest.mark.parametrize(
    "optimizer",
    [
        rbm_pb2.OptimizerSpec(kind=rbm_pb2.OPTIMIZER_KIND_SSD, lr=1e-2),  # auto: Newton–Schulz
        rbm_pb2.OptimizerSpec(
            kind=rbm_pb2.OPTIMIZER_KIND_SSD, lr=1e-2, method=rbm_pb2.POLAR_METHOD_LOWRANK
        ),
        rbm_pb2.OptimizerSpec(kind=rbm_pb2.OPTIMIZER_KIND_NESTEROV, lr=0.05),
    ],
    ids=["ssd-auto", "ssd-lowrank", "nesterov"],
)
def test_the_worker_process_trains_a_job_on_cuda(tmp_path, optimizer):
    messages = run_job(tmp_path, optimizer)
    kinds = [m.kind for m in messages]
    assert kinds[0] == protocol.STARTED and kinds[-1] == protocol.FINISHED, messages[-1].fields
    assert json.loads(messages[0].fields["runtime"])["device"].startswith("cuda")
    metrics = [
        rbm_pb2.Metrics.FromString(m.blobs["metrics"]) for m in messages if m.kind == "metrics"
    ]
    final_step = messages[-1].fields["step"]
    assert [m.step for m in metrics] == [*range(10, final_step, 10), final_step]
    assert metrics[-1].reconstruction_error < metrics[0].reconstruction_error
    checkpoints = [m for m in messages if m.kind == protocol.CHECKPOINT]
    assert checkpoints and checkpoints[-1].fields["step"] == final_step
    model = model_from_bytes(checkpoints[-1].blobs["model"], device="cpu")  # loads off the GPU
    assert model.W.device.type == "cpu" and bool(torch.isfinite(model.W).all())
