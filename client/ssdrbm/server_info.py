"""What a service says about itself (``GetServerInfo``): :class:`ServerInfo`."""

from __future__ import annotations

from dataclasses import dataclass

from ssdrbm.spec import from_message
from ssdrbm.v1 import rbm_pb2


@dataclass(frozen=True)
class ServerInfo:
    """The service's version, the API it implements (``"ssdrbm.v1"``), the Python and torch it
    runs on, and the optional features it serves (e.g. ``"onnx-export"``)."""

    version: str
    api: str
    python_version: str
    torch_version: str
    features: tuple[str, ...]

    @classmethod
    def from_proto(cls, message: rbm_pb2.ServerInfo) -> ServerInfo:
        return from_message(cls, message)
