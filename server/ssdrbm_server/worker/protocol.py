"""Messages between a worker and its training child process, over a multiprocessing pipe.

A message is a JSON header (`kind`, plain fields, the names and sizes of binary parts) followed
by its binary parts as raw byte frames. Nothing is pickled: both ends only ever decode JSON and
copy bytes.

Child -> worker:
    started      start_step, runtime                      the data is loaded, training begins
    metrics      step                   + metrics         a serialized ssdrbm.v1.Metrics
    backoff      rollback_step          + backoff         a blow-up, rolled back (ssdrbm.v1.Backoff)
                                                          to the last healthy evaluation; a
                                                          checkpoint of that step comes first
                                                          unless the last one is there already
    checkpoint   step, config_json,     + model, trainer  safetensors bytes; recovery_state is
                 recovery_state                           the detector's references (JSON)
    finished     step                                     the last step is trained and saved
    stopped      step                                     stopped on request, after a checkpoint
    failed       step, reason, diverged                   training cannot go on
    progress     runs: [[steps, seconds], ...]            steps trained since the last one and
                                                          their time (the worker's metrics);
                                                          sent before any other message and at
                                                          least every PROGRESS_INTERVAL_S
    alive                                                 a heartbeat: still making progress
                                                          (also sent once warm, before a job)
Worker -> child:
    start        settings, backoffs, total_steps, n_visible, upload info, log_context,
                 recovery_state (kept with the resume checkpoint)
                                            + spec, dataset, resume
    stop                                                  checkpoint now, end with "stopped"
    stop_run     run                                      checkpoint run ``run`` now (a job
                                                          alone: 0), end it with "stopped"
                                                          (a sweep's early stopping)

Packed training (worker/child.py, worker/run_sets.py, worker/runner.py): the worker sends one
    start_pack   settings, upload info,
                 jobs: [{backoffs, total_steps, n_visible, log_context, recovery_state}]
                                            + spec.<i>, resume.<i> (run i), dataset (shared)
    drop         run                                      run i leaves the pack, nothing more
                                                          is sent for it (cancel, lost lease)
and every child message above about one job carries ``run`` (the job's index in jobs);
progress counts the pack's steps (every run trained them), alive and stop are the pack's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

# Message kinds, child -> worker
STARTED, METRICS, BACKOFF, CHECKPOINT = "started", "metrics", "backoff", "checkpoint"
FINISHED, STOPPED, FAILED, ALIVE, PROGRESS = "finished", "stopped", "failed", "alive", "progress"
# worker -> child
START, STOP, START_PACK, DROP, STOP_RUN = "start", "stop", "start_pack", "drop", "stop_run"

PROGRESS_INTERVAL_S = 1.0  # how stale the worker's step counts may get while steps run


@dataclass
class Message:
    """One message: its kind, JSON-safe fields and named binary parts."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)


def send(conn: Connection, message: Message) -> None:
    """Write a message: the JSON header, then each binary part in the header's order."""
    header = {
        "kind": message.kind,
        "fields": message.fields,
        "blobs": [[name, len(blob)] for name, blob in message.blobs.items()],
    }
    conn.send_bytes(json.dumps(header).encode())
    for blob in message.blobs.values():
        conn.send_bytes(blob)


def receive(conn: Connection) -> Message:
    """Read one message (blocking); EOFError when the other end has closed."""
    header = json.loads(conn.recv_bytes())
    blobs: dict[str, bytes] = {}
    for name, size in header["blobs"]:
        blob = conn.recv_bytes()
        if len(blob) != size:
            raise ValueError(f"part {name!r} has {len(blob)} bytes, header said {size}")
        blobs[name] = blob
    return Message(header["kind"], header["fields"], blobs)
