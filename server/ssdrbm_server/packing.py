"""A job's pack key: which queued jobs a worker may train together in one pack.

Computed once, at submit, and stored in the job's record (``pack_key``), so a worker matches jobs
by comparing strings, without loading a spec, a dataset or torch. Two jobs share a key when
:func:`ssdcore.pack.pack_key` says their runs fit one pack (model kind, variance form and shape,
batch size, CD-k, persistence, one update rule for every parameter) and one data tensor serves
both: the same dataset, preprocessing and validation split (drawn with ``training.seed``, so jobs
that differ in seed get different keys). The polar method counts as requested, since AUTO
resolves per device; everything else (step sizes and schedule, momentum, weight decay, steps,
evaluation and checkpoint spacing, backoff policy) may differ within a pack.
"""

from __future__ import annotations

import hashlib
import json

from ssdrbm.v1 import rbm_pb2 as pb

from ssdcore.pack import pack_key
from ssdrbm_server.job_spec import model_config, optimizer_config
from ssdrbm_server.store.records import NOT_PACKABLE


def job_pack_key(spec: pb.StartTrainingRequest, n_visible: int) -> str:
    """The resolved job's pack key (32 hex digits), or NOT_PACKABLE."""
    training = spec.training
    if training.HasField("parallel_tempering") or training.HasField("centering"):
        return NOT_PACKABLE  # Trainer options packs do not run (tempered chains, centering)
    try:
        runs = pack_key(
            model_config(spec, n_visible),
            optimizer_config(spec.optimizer),
            batch_size=training.batch_size,
            cd_k=training.cd_k,
            persistent=training.persistent,
            device="cpu",
        )
    except ValueError:  # a full-covariance Gaussian model, an optimizer setting packs do not run
        return NOT_PACKABLE
    dataset = spec.dataset
    if dataset.WhichOneof("source") == "dataset_id":
        source: object = ["upload", dataset.dataset_id]
    else:
        source = ["builtin", dataset.builtin.name, sorted(dataset.builtin.options.items())]
    data = [
        source,
        int(dataset.preprocess),
        repr(float(spec.eval.validation_fraction)),
        int(training.seed),  # the validation split's seed
    ]
    text = json.dumps([repr(runs), int(spec.optimizer.method), data], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
