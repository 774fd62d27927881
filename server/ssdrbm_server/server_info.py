"""GetServerInfo: the service's version, the API it implements and its optional features.

The version is the product's one version (the repository's VERSION file, which all three
distributions read; ``ssdrbm.__version__`` where installed), so a server and a client built from
the same checkout report the same number.
"""

from __future__ import annotations

import platform
from importlib import metadata

import ssdrbm
from ssdrbm.v1 import rbm_pb2

# Optional capabilities a client may look for before using them; a capability the service gains
# adds its name here once it is served.
FEATURES: tuple[str, ...] = (
    "onnx-export",  # ExportModel(format=EXPORT_FORMAT_ONNX), ssdrbm_server/model_export.py
    "open-inference",  # the Open Inference Protocol (KServe v2) on the same port, inference/
)


def _installed_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


def server_info() -> rbm_pb2.ServerInfo:
    """What GetServerInfo answers; nothing in it depends on the caller or on Redis."""
    return rbm_pb2.ServerInfo(
        version=ssdrbm.__version__,
        api=rbm_pb2.DESCRIPTOR.package,
        python_version=platform.python_version(),
        # From the installed metadata: no need to import torch into the API process for this.
        torch_version=_installed_version("torch"),
        features=list(FEATURES),
    )
