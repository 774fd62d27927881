"""Uploaded datasets: raw little-endian arrays with dtype and shape, content-addressed.

The id is the sha256 of the dtype, the shape and the bytes, so the same upload always gives the
same id and is stored once (`dataset:<id>`), however many tenants upload it. Each tenant sees
only the datasets it uploaded itself (`tenant:{<t>}:datasets`, id -> the name it gave). The
bytes are never unpickled: readers rebuild the array with numpy.frombuffer.

The two keys are in different Cluster slots, so an upload stores the array first and then adds
it to the tenant's datasets. Dying in between leaves an array no tenant sees; the next upload
of the same content finds it stored and adds the tenant's entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ssdrbm_server.errors import InvalidArgumentError, NotFoundError
from ssdrbm_server.keys import Keys, is_dataset_id
from ssdrbm_server.store.connection import RedisClient

logger = logging.getLogger(__name__)

# Element size in bytes of each accepted dtype (numpy names; all little-endian).
ITEM_SIZES = {"float32": 4, "float64": 8, "uint8": 1}

# KEYS: dataset. ARGV: the dataset's fields as pairs. Content-addressed: stored once, whole.
_STORE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
end
return 1
"""


@dataclass
class DatasetInfo:
    """What is known about a stored dataset without reading its bytes."""

    id: str
    shape: tuple[int, ...]
    dtype: str
    name: str
    size_bytes: int
    # smallest and largest value, as measured on upload (None for arrays stored without it)
    value_range: tuple[float, float] | None = None


def dataset_id(shape: Sequence[int], dtype: str, data: bytes) -> str:
    """Content address of an array: sha256 over its dtype, shape and bytes."""
    digest = hashlib.sha256()
    digest.update(f"{dtype}:{','.join(str(n) for n in shape)}\n".encode())
    digest.update(data)
    return digest.hexdigest()


def check_array(shape: Sequence[int], dtype: str, size_bytes: int) -> tuple[int, ...]:
    """Validate dtype and shape against the byte count; returns the shape as a tuple."""
    if dtype not in ITEM_SIZES:
        raise InvalidArgumentError("dtype", f"must be one of {sorted(ITEM_SIZES)}, not {dtype!r}")
    dims = tuple(int(n) for n in shape)
    if len(dims) not in (2, 3) or any(n < 1 for n in dims):
        raise InvalidArgumentError(
            "shape",
            f"must be (n_examples, n_features) or (n_examples, height, width) with every "
            f"dimension >= 1, not {list(dims)}",
        )
    expected = math.prod(dims) * ITEM_SIZES[dtype]
    if expected != size_bytes:
        raise InvalidArgumentError(
            "data",
            f"shape {list(dims)} of {dtype} needs {expected} bytes but {size_bytes} were sent",
        )
    return dims


class DatasetStore:
    """Stores and loads uploaded arrays, scoped to the tenant that uploaded them."""

    def __init__(self, redis: RedisClient, *, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._store = redis.register_script(_STORE)

    async def put(
        self,
        tenant: str,
        *,
        shape: Sequence[int],
        dtype: str,
        name: str,
        data: bytes,
        value_range: tuple[float, float] | None = None,
    ) -> tuple[DatasetInfo, bool]:
        """Store an array (once per content); returns (info, created for this tenant)."""
        dims = check_array(shape, dtype, len(data))
        new_id = dataset_id(dims, dtype, data)
        fields: dict[str, str | bytes | int] = {
            "shape": json.dumps(list(dims)),
            "dtype": dtype,
            "size_bytes": len(data),
            "data": data,
        }
        if value_range is not None:
            fields["value_range"] = json.dumps(list(value_range))
        args: list[str | bytes | int] = []
        for field, value in fields.items():
            args += [field, value]
        await self._store(keys=[self.keys.dataset(new_id)], args=args)
        # Only after the array is stored: a tenant never sees a dataset that is not there.
        added = await self.redis.hsetnx(self.keys.tenant_datasets(tenant), new_id, name)
        if added:
            logger.info("dataset %s %s %s stored for tenant %s", new_id, dtype, dims, tenant)
        return await self.info(tenant, new_id), bool(added)

    async def info(self, tenant: str, dataset_id: str) -> DatasetInfo:
        """Shape, dtype, name and size; NotFoundError when the tenant has no such dataset."""
        if not is_dataset_id(dataset_id):
            raise _not_found(dataset_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.tenant_datasets(tenant), dataset_id)
            pipe.hmget(
                self.keys.dataset(dataset_id), ["shape", "dtype", "size_bytes", "value_range"]
            )
            name, (shape, dtype, size_bytes, value_range) = await pipe.execute()
        if name is None or shape is None:
            raise _not_found(dataset_id)
        return DatasetInfo(
            id=dataset_id,
            shape=tuple(json.loads(shape)),
            dtype=dtype.decode(),
            name=name.decode(),
            size_bytes=int(size_bytes),
            value_range=tuple(json.loads(value_range)) if value_range else None,
        )

    async def load(self, tenant: str, dataset_id: str) -> tuple[DatasetInfo, bytes]:
        """Info and raw bytes of a dataset the tenant uploaded."""
        info = await self.info(tenant, dataset_id)
        data = await self.redis.hget(self.keys.dataset(dataset_id), "data")
        if data is None:
            raise _not_found(dataset_id)
        return info, data


def _not_found(dataset_id: str) -> NotFoundError:
    return NotFoundError(
        f"dataset {dataset_id[:80]!r} not found; upload it with UploadDataset and use the "
        "returned dataset_id"
    )
