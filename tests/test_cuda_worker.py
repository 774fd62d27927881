"""The worker's training process on a CUDA device: a job over its pipe, as the worker runs it.

Skipped without a CUDA device. No Redis is involved: the test plays the worker's side of the
pipe protocol (ssdrbm_server/worker/protocol.py), so it runs wherever the CUDA tests run.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore.checkpoint import model_from_bytes
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.child import train_one
from ssdrbm_server.worker.defaults import PlanDefaults

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def start_message(tmp_path, optimizer: rbm_pb2.OptimizerSpec) -> protocol.Message:
    request = rbm_pb2.StartTrainingRequest(
        model=rbm_pb2.ModelSpec(kind=rbm_pb2.MODEL_KIND_BERNOULLI, n_hidden=12),
        optimizer=optimizer,
        training=rbm_pb2.TrainingSpec(epochs=2, batch_size=50, seed=3),
        dataset=rbm_pb2.DatasetRef(
            builtin=rbm_pb2.BuiltinDataset(name="synthetic", options={"n_samples": "1000"})
        ),
    )
    defaults = PlanDefaults(eval_every=10, checkpoint_every=20)
    fields = {"data_dir": str(tmp_path), "defaults": vars(defaults), "torch_threads": 0}
    return protocol.Message(protocol.START, fields, {"spec": request.SerializeToString()})


def run_job(tmp_path, optimizer: rbm_pb2.OptimizerSpec) -> list[protocol.Message]:
    worker_end, child_end = multiprocessing.Pipe()
    thread = threading.Thread(
        target=train_one, args=(child_end, start_message(tmp_path, optimizer))
    )
    thread.start()
    messages = []
    while not messages or messages[-1].kind not in (protocol.FINISHED, protocol.FAILED):
        messages.append(protocol.receive(worker_end))
    thread.join(timeout=60)
    return messages


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
    assert messages[0].fields["device"].startswith("cuda")
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
