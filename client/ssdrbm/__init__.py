"""ssdrbm: the Python SDK and CLI of the ssdrbm RBM training service.

Needs only grpcio, protobuf and numpy (matplotlib for ``ssdrbm plot``); never torch or Redis.
"""

from __future__ import annotations

from importlib.metadata import version as _installed_version

from ssdrbm.client import Client
from ssdrbm.connection import TLS
from ssdrbm.datasets import Dataset, UploadedDataset
from ssdrbm.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServerError,
    SSDRBMError,
    Unauthenticated,
    Unavailable,
)
from ssdrbm.events import (
    BackoffEvent,
    Job,
    JobState,
    MetricEvent,
    Metrics,
    MetricsEvent,
    QueuePlace,
    StateEvent,
)
from ssdrbm.model_file import ExportedModel, read_safetensors
from ssdrbm.retry import RetryPolicy
from ssdrbm.server_info import ServerInfo
from ssdrbm.sweeps import Sweep, SweepRun, SweepState

# The product's one version is the repository's VERSION file, which all three distributions
# (ssdcore, ssdrbm-client, ssdrbm-server) read when they are built; an installed client reports it.
__version__ = _installed_version("ssdrbm-client")

__all__ = [
    "TLS",
    "AlreadyExists",
    "BackoffEvent",
    "Client",
    "Dataset",
    "DeadlineExceeded",
    "ExportedModel",
    "FailedPrecondition",
    "IntegrityError",
    "InvalidArgument",
    "Job",
    "JobState",
    "MetricEvent",
    "Metrics",
    "MetricsEvent",
    "NotFound",
    "PermissionDenied",
    "QueuePlace",
    "ResourceExhausted",
    "RetryPolicy",
    "SSDRBMError",
    "ServerError",
    "ServerInfo",
    "StateEvent",
    "Sweep",
    "SweepRun",
    "SweepState",
    "Unauthenticated",
    "Unavailable",
    "UploadedDataset",
    "__version__",
    "read_safetensors",
]
