"""Model export: gather the ExportModel stream, check it, and write or parse it.

Shared by the blocking and the asyncio clients.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssdrbm.errors import IntegrityError
from ssdrbm.model_file import CONFIG_NAME, SAFETENSORS_NAME, ExportedModel
from ssdrbm.v1 import rbm_pb2


@dataclass(frozen=True)
class ModelDownload:
    """A model export as received: the header's config and the checked safetensors bytes."""

    config_json: str
    step: int
    data: bytes

    @classmethod
    def from_parts(cls, header: rbm_pb2.ModelExportHeader | None, chunks: list[bytes]):
        """Check size and sha256 of the received bytes against the header."""
        if header is None:
            raise IntegrityError("model export: the stream carried no header")
        data = b"".join(chunks)
        if header.size_bytes and len(data) != header.size_bytes:
            raise IntegrityError(
                f"model export: received {len(data)} bytes, expected {header.size_bytes}"
            )
        digest = hashlib.sha256(data).hexdigest()
        if header.sha256 and digest != header.sha256.lower():
            raise IntegrityError("model export: sha256 of the received bytes does not match")
        return cls(config_json=header.config_json, step=header.step, data=data)

    def model(self) -> ExportedModel:
        """Parse into numpy tensors (no torch needed)."""
        config = json.loads(self.config_json) if self.config_json else None
        return ExportedModel.from_bytes(self.data, config=config, step=self.step)

    def write(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (made if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / SAFETENSORS_NAME).write_bytes(self.data)
        config = json.loads(self.config_json) if self.config_json else {}
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return directory


def collect_export(messages: Any) -> ModelDownload:
    """Gather an ExportModel stream (header first, then chunks)."""
    header, chunks = None, []
    for message in messages:
        if message.WhichOneof("part") == "header":
            header = message.header
        else:
            chunks.append(message.chunk)
    return ModelDownload.from_parts(header, chunks)
