"""Uploaded datasets: raw little-endian arrays with dtype and shape, content-addressed, chunked.

The id is the sha256 of the dtype, the shape and the bytes: the same upload is stored once,
however many tenants upload it. The bytes are never unpickled (numpy.frombuffer).

No Redis value is larger than `Settings.dataset_chunk_bytes` (one huge value blocks Redis for
seconds). An upload writes its chunks as they arrive to `upload:{<uid>}` (field `<i>` = chunk i),
expiring `upload_idle_seconds` after the last write; the record `dataset:{<id>}` then points at
them (`blob` = uid), since the content address is known only at the end and a RENAME may not
cross Cluster slots.

Committing takes single-slot steps in an order safe to die between (readers see a dataset only
once `complete` is set and the tenant's entry is there):

1. COMMIT on `{<id>}`: a complete record gets the tenant added to `dataset:{<id>}:tenants`
   (this upload's chunks are dropped); while another upload of the same bytes commits, wait;
   otherwise the record points at this upload (`blob`, `pending_since`, no `complete`). A record
   left pending for PENDING_STALE_MS by a dead upload is taken over, its chunks dropped.
2. SEAL on `{<uid>}`: every chunk is there; they are made permanent (PERSIST).
3. COMPLETE on `{<id>}`: if the record still points at this upload, set `complete` and add the
   tenant's reference; losing to a concurrent upload answers "retry" (UNAVAILABLE), and the
   retry finds the content stored.
4. ADD on `{<t>}`: the tenant's entry (`tenant:{<t>}:datasets`, id -> JSON name, size, time) and
   its bytes (`tenant:{<t>}:dataset_bytes`), refused over the quota (the reference is released).

Deleting is the reverse: the tenant's entry, then its reference; the last reference takes the
record and the chunks. The first step is refused while the tenant's QUEUED or RUNNING jobs
train on the dataset (`tenant:{<t>}:job_datasets`, taken on the same slot as a submit's
reservation, store/jobs.py): the submit finds the dataset gone (NOT_FOUND), or the delete finds
the job (FAILED_PRECONDITION). Dying between steps leaves a reference the tenant no longer lists
or chunks no record points at; neither is ever read.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ssdrbm.datasets import UPLOAD_DTYPES_BY_NAME

from ssdrbm_server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    tenant_subject,
)
from ssdrbm_server.keys import Keys, is_dataset_id
from ssdrbm_server.store.connection import RedisClient, Store, pairs

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_IDLE_SECONDS = 600.0
DEFAULT_TENANT_QUOTA = 2 * 1024 * 1024 * 1024

# KEYS: dataset, its tenants. ARGV: upload id, tenant, how long (ms) another upload's pending
# commit is waited for before it counts as dead, then the record's fields as pairs.
_COMMIT = """
if redis.call('HGET', KEYS[1], 'complete') == '1' then
  redis.call('SADD', KEYS[2], ARGV[2])
  return {'exists', ''}
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local old = redis.call('HGET', KEYS[1], 'blob') or ''
local since = tonumber(redis.call('HGET', KEYS[1], 'pending_since') or '0')
if old ~= '' and old ~= ARGV[1] and now_ms - since < tonumber(ARGV[3]) then
  return {'busy', old}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'blob', ARGV[1], 'pending_since', now_ms, unpack(ARGV, 4))
return {'pending', old}
"""
# A commit in progress finishes within milliseconds (SEAL and COMPLETE); one pending longer than
# this died, and the next upload of the same bytes takes the record over.
PENDING_STALE_MS = 30_000
# How long an upload waits for another one's commit of the same bytes before answering "retry".
BUSY_WAIT_S = 0.05
BUSY_TRIES = 100

# KEYS: upload. ARGV: number of chunks. All chunks there: keep them for good.
_SEAL = """
if redis.call('HLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
redis.call('PERSIST', KEYS[1])
return 1
"""

# KEYS: dataset, its tenants. ARGV: upload id, tenant.
_COMPLETE = """
if redis.call('HGET', KEYS[1], 'blob') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'complete', '1')
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""

# KEYS: tenant datasets, tenant bytes. ARGV: id, entry JSON, size, quota.
# Returns {1, used} added, {0, used} already there, {-1, used} over the quota.
_ADD = """
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return {0, used} end
if used + tonumber(ARGV[3]) > tonumber(ARGV[4]) then return {-1, used} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCRBY', KEYS[2], ARGV[3])
return {1, used + tonumber(ARGV[3])}
"""

# KEYS: tenant datasets, tenant bytes, tenant job datasets. ARGV: id, size.
# Returns {1} removed, {0} was not there, {-1, job id...} used by those active jobs.
_REMOVE = """
local users = {-1}
local references = redis.call('HGETALL', KEYS[3])
for i = 1, #references, 2 do
  if references[i + 1] == ARGV[1] then users[#users + 1] = references[i] end
end
if #users > 1 then return users end
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return {0} end
if tonumber(redis.call('DECRBY', KEYS[2], ARGV[2])) < 0 then redis.call('SET', KEYS[2], 0) end
return {1}
"""

# KEYS: dataset, its tenants. ARGV: tenant. Returns the upload id to unlink, '' while referenced.
_RELEASE = """
redis.call('SREM', KEYS[2], ARGV[1])
if redis.call('SCARD', KEYS[2]) > 0 then return '' end
local blob = redis.call('HGET', KEYS[1], 'blob') or ''
redis.call('DEL', KEYS[1], KEYS[2])
return blob
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
    created_at: float = 0.0  # when this tenant first stored it (Unix seconds)


def dataset_id(shape: Sequence[int], dtype: str, data: bytes) -> str:
    """Content address of an array: sha256 over its dtype, shape and bytes."""
    digest = _content_digest(shape, dtype)
    digest.update(data)
    return digest.hexdigest()


def _content_digest(shape: Sequence[int], dtype: str) -> hashlib._Hash:
    digest = hashlib.sha256()
    digest.update(f"{dtype}:{','.join(str(n) for n in shape)}\n".encode())
    return digest


def check_array(shape: Sequence[int], dtype: str, size_bytes: int | None) -> tuple[int, ...]:
    """Validate dtype and shape (and, when given, the byte count); returns the shape."""
    if dtype not in UPLOAD_DTYPES_BY_NAME:
        raise InvalidArgumentError(
            "dtype", f"must be one of {sorted(UPLOAD_DTYPES_BY_NAME)}, not {dtype!r}"
        )
    dims = tuple(int(n) for n in shape)
    if len(dims) not in (2, 3) or any(n < 1 for n in dims):
        raise InvalidArgumentError(
            "shape",
            f"must be (n_examples, n_features) or (n_examples, height, width) with every "
            f"dimension >= 1, not {list(dims)}",
        )
    expected = math.prod(dims) * UPLOAD_DTYPES_BY_NAME[dtype].itemsize
    if size_bytes is not None and expected != size_bytes:
        raise InvalidArgumentError(
            "data",
            f"shape {list(dims)} of {dtype} needs {expected} bytes but {size_bytes} were sent",
        )
    return dims


class DatasetStore(Store):
    """Stores and loads uploaded arrays, scoped to the tenants that uploaded them."""

    def __init__(
        self,
        redis: RedisClient,
        *,
        keys: Keys | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        idle_seconds: float = DEFAULT_IDLE_SECONDS,
        tenant_quota: int = DEFAULT_TENANT_QUOTA,
    ) -> None:
        super().__init__(redis, keys=keys)
        self.chunk_bytes = chunk_bytes
        self.idle_ms = max(1, int(idle_seconds * 1000))
        self.tenant_quota = tenant_quota

    def begin(
        self,
        tenant: str,
        *,
        shape: Sequence[int],
        dtype: str,
        name: str,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> Upload:
        """An upload to feed with `write` and finish with `commit` (or `abort`)."""
        dims = check_array(shape, dtype, None)
        size = math.prod(dims) * UPLOAD_DTYPES_BY_NAME[dtype].itemsize
        if size > self.tenant_quota:
            raise _over_quota(tenant, size, 0, self.tenant_quota)
        return Upload(self, tenant, dims, dtype, name, on_chunk)

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
        """Store a whole array at once (tests, small arrays); see `begin` for streaming."""
        check_array(shape, dtype, len(data))
        upload = self.begin(tenant, shape=shape, dtype=dtype, name=name)
        try:
            await upload.write(data)
            return await upload.commit(value_range)
        except BaseException:
            await upload.abort()
            raise

    async def used_bytes(self, tenant: str) -> int:
        """Bytes of the tenant's stored datasets (what the quota counts)."""
        return int(await self.redis.get(self.keys.tenant_dataset_bytes(tenant)) or 0)

    async def info(self, tenant: str, dataset_id: str) -> DatasetInfo:
        """Shape, dtype, name and size; NotFoundError when the tenant has no such dataset."""
        if not is_dataset_id(dataset_id):
            raise dataset_not_found(dataset_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.tenant_datasets(tenant), dataset_id)
            pipe.hmget(self.keys.dataset(dataset_id), _RECORD_FIELDS)
            entry, record = await pipe.execute()
        info = _info(dataset_id, entry, record)
        if info is None:
            raise dataset_not_found(dataset_id)
        return info

    async def load(self, tenant: str, dataset_id: str) -> tuple[DatasetInfo, bytes]:
        """Info and raw bytes of a dataset the tenant uploaded, read one chunk at a time (a
        pipeline of them all would hold Redis as long as one huge value)."""
        info = await self.info(tenant, dataset_id)
        blob, chunks = await self.redis.hmget(self.keys.dataset(dataset_id), ["blob", "chunks"])
        if blob is None or chunks is None:
            raise dataset_not_found(dataset_id)
        upload_key = self.keys.upload(blob.decode())
        parts: list[bytes] = []
        for index in range(int(chunks)):
            part = await self.redis.hget(upload_key, str(index))
            if part is None:
                raise dataset_not_found(dataset_id)
            parts.append(part)
        data = b"".join(parts)
        if len(data) != info.size_bytes:
            raise dataset_not_found(dataset_id)
        return info, data

    async def list(
        self, tenant: str, *, page_size: int, page_token: str
    ) -> tuple[list[DatasetInfo], str]:
        """One page of the tenant's datasets ordered by id, and the next page's token ("" at
        the end): the token is the last id returned, so paging survives deletions."""
        if page_token and not is_dataset_id(page_token):
            raise InvalidArgumentError("page_token", "is not a token from ListDatasets")
        entries = await self.redis.hgetall(self.keys.tenant_datasets(tenant))
        ids = sorted(key.decode() for key in entries)
        ids = [i for i in ids if i > page_token][: page_size + 1]
        page_ids, more = ids[:page_size], len(ids) > page_size
        async with self.redis.pipeline(transaction=False) as pipe:
            for item in page_ids:
                pipe.hmget(self.keys.dataset(item), _RECORD_FIELDS)
            records = await pipe.execute() if page_ids else []
        page = []
        for item, record in zip(page_ids, records, strict=True):
            info = _info(item, entries[item.encode()], record)
            if info is not None:
                page.append(info)
        return page, (page_ids[-1] if more else "")

    async def delete(self, tenant: str, dataset_id: str) -> DatasetInfo:
        """Drop the tenant's dataset (its bytes go with the last reference); DatasetInUseError
        while the tenant's queued or running jobs hold it."""
        info = await self.info(tenant, dataset_id)
        status, *users = await self.run(
            _REMOVE,
            keys=[
                self.keys.tenant_datasets(tenant),
                self.keys.tenant_dataset_bytes(tenant),
                self.keys.tenant_job_datasets(tenant),
            ],
            args=[dataset_id, info.size_bytes],
        )
        if status < 0:
            raise DatasetInUseError(dataset_id, sorted(user.decode() for user in users))
        await self._drop_reference(tenant, dataset_id)
        logger.info("dataset %s deleted for tenant %s", dataset_id, tenant)
        return info

    async def _drop_reference(self, tenant: str, dataset_id: str) -> None:
        blob = await self.run(
            _RELEASE,
            keys=[self.keys.dataset(dataset_id), self.keys.dataset_tenants(dataset_id)],
            args=[tenant],
        )
        if blob:
            # UNLINK: the chunks are freed off Redis's main thread.
            await self.redis.unlink(self.keys.upload(blob.decode()))
            logger.info("dataset %s: no tenant references it; its bytes were removed", dataset_id)


_RECORD_FIELDS = ["shape", "dtype", "size_bytes", "value_range", "complete"]


def _info(dataset_id: str, entry: bytes | None, record: list[bytes | None]) -> DatasetInfo | None:
    """The info of a tenant's entry and the dataset's record; None unless both exist, complete."""
    shape, dtype, size_bytes, value_range, complete = record
    if entry is None or shape is None or complete != b"1":
        return None
    details = _entry(entry)
    return DatasetInfo(
        id=dataset_id,
        shape=tuple(json.loads(shape)),
        dtype=dtype.decode(),
        name=str(details.get("name", "")),
        size_bytes=int(size_bytes),
        value_range=tuple(json.loads(value_range)) if value_range else None,
        created_at=float(details.get("created_at", 0.0)),
    )


def _entry(raw: bytes) -> dict[str, object]:
    """A tenant's entry: JSON, or (stored before chunking) the bare name."""
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"name": raw.decode(errors="replace")}


class Upload:
    """One upload in progress: chunks go to Redis as they fill, the content address is computed
    on the way, and nothing is visible until `commit`."""

    def __init__(
        self,
        store: DatasetStore,
        tenant: str,
        shape: tuple[int, ...],
        dtype: str,
        name: str,
        on_chunk: Callable[[bytes], None] | None,
    ) -> None:
        self.store = store
        self.tenant = tenant
        self.shape = shape
        self.dtype = dtype
        self.name = name
        self.size_bytes = math.prod(shape) * UPLOAD_DTYPES_BY_NAME[dtype].itemsize
        self.upload_id = uuid.uuid4().hex
        self.received = 0
        self._on_chunk = on_chunk
        self._digest = _content_digest(shape, dtype)
        self._buffer = bytearray()
        self._chunks = 0
        self._key = store.keys.upload(self.upload_id)
        # Set before the chunks are made permanent: from then on they may be the stored
        # content, and only the commit steps may remove them.
        self._kept = False

    async def write(self, data: bytes) -> None:
        """Append bytes; every full chunk goes to Redis at once."""
        self.received += len(data)
        if self.received > self.size_bytes:
            raise InvalidArgumentError(
                "chunk",
                f"received more than the {self.size_bytes} bytes that the shape and dtype describe",
            )
        self._buffer += data
        size = self.store.chunk_bytes
        while len(self._buffer) >= size:
            chunk = bytes(self._buffer[:size])
            del self._buffer[:size]
            await self._flush(chunk)

    async def _flush(self, chunk: bytes) -> None:
        if self._on_chunk is not None:
            self._on_chunk(chunk)
        self._digest.update(chunk)
        async with self.store.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self._key, str(self._chunks), chunk)
            # Refreshed with every chunk: a slow upload keeps its earlier chunks.
            pipe.pexpire(self._key, self.store.idle_ms)
            await pipe.execute()
        self._chunks += 1

    async def finish(self) -> None:
        """Check every byte arrived and write the last, partial, chunk (`commit` calls it)."""
        if self.received != self.size_bytes:
            raise InvalidArgumentError(
                "chunk",
                f"received {self.received} bytes, but the shape and dtype need {self.size_bytes}",
            )
        if self._buffer:
            await self._flush(bytes(self._buffer))
            self._buffer.clear()

    async def commit(
        self, value_range: tuple[float, float] | None = None
    ) -> tuple[DatasetInfo, bool]:
        """Make the upload visible to its tenant; returns (info, created for this tenant)."""
        await self.finish()
        new_id = self._digest.hexdigest()
        store, keys = self.store, self.store.keys
        dataset_keys = [keys.dataset(new_id), keys.dataset_tenants(new_id)]
        outcome, replaced = await self._commit_record(dataset_keys, value_range)
        if outcome == b"busy":
            await self.abort()
            raise UnavailableError(
                f"another upload of the same content (dataset {new_id}) is being stored; retry "
                "the upload, it will find the content stored"
            )
        if outcome == b"exists":
            await self.abort()  # the same bytes are stored already
        else:
            if replaced and replaced.decode() != self.upload_id:
                await store.redis.unlink(keys.upload(replaced.decode()))
            await self._seal_and_complete(new_id, dataset_keys)
        created = await self._add_for_tenant(new_id)
        return await store.info(self.tenant, new_id), created

    async def _commit_record(
        self, dataset_keys: list[str], value_range: tuple[float, float] | None
    ) -> tuple[bytes, bytes]:
        """Step 1; while another upload of the same bytes is committing, wait for it."""
        record = {
            "shape": json.dumps(list(self.shape)),
            "dtype": self.dtype,
            "size_bytes": self.size_bytes,
            "chunks": self._chunks,
        }
        if value_range is not None:
            record["value_range"] = json.dumps(list(value_range))
        args = [self.upload_id, self.tenant, PENDING_STALE_MS, *pairs(record)]
        for _ in range(BUSY_TRIES):
            outcome, replaced = await self.store.run(_COMMIT, keys=dataset_keys, args=args)
            if outcome != b"busy":
                break
            await asyncio.sleep(BUSY_WAIT_S)
        return outcome, replaced

    async def _seal_and_complete(self, new_id: str, dataset_keys: list[str]) -> None:
        store = self.store
        self._kept = True
        sealed = await store.run(_SEAL, keys=[self._key], args=[self._chunks])
        completed = sealed and await store.run(
            _COMPLETE, keys=dataset_keys, args=[self.upload_id, self.tenant]
        )
        if not completed:
            await store.redis.unlink(self._key)
            raise UnavailableError(
                f"a concurrent upload of the same content (dataset {new_id}) took over while "
                "this one was being stored; retry the upload, it will find the content stored"
            )
        logger.info("dataset %s %s %s stored", new_id, self.dtype, self.shape)

    async def _add_for_tenant(self, new_id: str) -> bool:
        store, keys = self.store, self.store.keys
        entry = json.dumps({"name": self.name, "created_at": time.time()})
        code, used = await store.run(
            _ADD,
            keys=[keys.tenant_datasets(self.tenant), keys.tenant_dataset_bytes(self.tenant)],
            args=[new_id, entry, self.size_bytes, store.tenant_quota],
        )
        if int(code) < 0:
            await store._drop_reference(self.tenant, new_id)
            raise _over_quota(self.tenant, self.size_bytes, int(used), store.tenant_quota)
        if int(code) == 1:
            logger.info("dataset %s added for tenant %s", new_id, self.tenant)
        return int(code) == 1

    async def abort(self) -> None:
        """Drop this upload's chunks, unless they may already be the stored content."""
        if not self._kept:
            await self.store.redis.unlink(self._key)


def _over_quota(tenant: str, size: int, used: int, quota: int) -> ResourceExhaustedError:
    return ResourceExhaustedError(
        f"this dataset ({size} bytes) would take the tenant's stored datasets to {used + size} "
        f"bytes, over max_dataset_bytes_per_tenant ({quota}, SSDRBM_MAX_DATASET_BYTES_PER_TENANT); "
        "delete datasets you no longer need (ssdrbm delete-dataset ID) or upload a smaller subset",
        limit="max_dataset_bytes_per_tenant",
        subject=tenant_subject(tenant),
    )


class DatasetInUseError(FailedPreconditionError):
    """The tenant's queued or running jobs `job_ids` train on the dataset."""

    SHOWN = 5  # job ids named in the message

    def __init__(self, dataset_id: str, job_ids: list[str]) -> None:
        shown = ", ".join(job_ids[: self.SHOWN])
        more = f" and {len(job_ids) - self.SHOWN} more" if len(job_ids) > self.SHOWN else ""
        super().__init__(
            f"dataset {dataset_id} is used by queued or running job(s) {shown}{more}; wait for "
            "them to finish or cancel them (`ssdrbm cancel JOB`), then delete the dataset",
            precondition="DATASET_IN_USE",
            subject=f"job:{job_ids[0]}",
        )
        self.job_ids = job_ids


def dataset_not_found(dataset_id: str) -> NotFoundError:
    return NotFoundError.for_id(
        "dataset", dataset_id, "upload it with UploadDataset and use the returned dataset_id"
    )
