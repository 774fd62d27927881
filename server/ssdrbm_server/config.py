"""Service configuration: one ``Settings`` dataclass read from ``SSDRBM_*`` environment variables.

Every tunable of the server and its worker lives here, with the reason for its default, so that
deployment (Docker, compose, the demo script) only ever sets environment variables.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ssdrbm_server.cpus import beyond_host, parse_cpu_list

ENV_PREFIX = "SSDRBM_"


class ConfigError(ValueError):
    """An environment variable holds a value that cannot be used."""


@dataclass(frozen=True)
class Settings:
    """Everything the server and its in-process worker need; see ``from_env``."""

    # Network
    # host:port for gRPC; port 0 picks a free port. Loopback unless told otherwise: another
    # address needs tokens or SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE (ssdrbm_server/exposure.py)
    listen_address: str = "127.0.0.1:50051"
    metrics_port: int = 9108  # Prometheus /metrics over HTTP; 0 disables the endpoint
    metrics_address: str = "127.0.0.1"
    # The HTTP front (ssdrbm_server/http_front.py): the Open Inference Protocol's REST form and
    # health, on its own port; 0 turns it off. Loopback unless told otherwise, as listen_address
    http_port: int = 8080
    http_address: str = "127.0.0.1"
    # /metrics of a worker-only process (python -m ssdrbm_server.worker), on metrics_address; 0
    # disables it. A worker inside the server process reports on metrics_port instead.
    worker_metrics_port: int = 9109

    # Storage
    redis_url: str = "redis://127.0.0.1:6379/0"  # redis:// or rediss:// (TLS), may hold a password
    redis_prefix: str = "ssdrbm:"  # every key starts with it, so one Redis can host several
    # true: redis_url names one node of a Redis Cluster (the other nodes are discovered from it)
    redis_cluster: bool = False
    # built-in real datasets (MNIST, Frey Face); empty: ssdcore's default, ../shared/data next to
    # the repository (ssdrbm_server/catalog.py data_directory decides, for every process)
    data_dir: str = ""

    # Limits, each answered with its own RESOURCE_EXHAUSTED message
    max_message_bytes: int = 64 * 1024 * 1024  # one gRPC message, both directions
    max_tensor_elements: int = 16 * 1024 * 1024  # elements of one Reconstruct/SampleHidden input
    max_dataset_bytes: int = 512 * 1024 * 1024  # one uploaded dataset
    # Stored datasets of one tenant, summed (content shared with other tenants counts for each)
    max_dataset_bytes_per_tenant: int = 2 * 1024 * 1024 * 1024
    # UploadDataset calls in progress at once, per API process: each buffers one chunk and
    # writes to Redis; excess calls are refused rather than queued
    max_concurrent_uploads: int = 4
    # ... of one tenant: below the server's, so one tenant's slow uploads leave the others room
    # (2: a training and a validation set at once)
    max_uploads_per_tenant: int = 2
    # Largest single Redis value of an uploaded dataset: the array is stored in chunks of this
    # size, so no one write or read blocks Redis for long (a multiple of 8, the widest dtype)
    dataset_chunk_bytes: int = 4 * 1024 * 1024
    # The chunks of a stopped upload (client gone, server died) expire this long after the last
    upload_idle_seconds: float = 600.0
    # Redis connections for ordinary calls; blocking metric reads (XREAD BLOCK) get their own
    # pool of max_streams + 1 connections, so live StreamMetrics followers never starve these
    redis_connections: int = 100
    # QUEUED + RUNNING jobs of one tenant. A sweep's runs are jobs, so this bounds sweeps too: 64
    # admits the grids people run (3 step sizes × 2 optimizers × 3 seeds is 18) with room to spare,
    # while the queue's tenant rotation keeps one tenant's backlog from delaying the others
    max_jobs_per_tenant: int = 64
    # Points (jobs) of one sweep (ssdrbm_server/sweeps/); a sweep must also fit in the tenant's
    # max_jobs_per_tenant beside its active jobs, which is checked before any job is created.
    # Equal to it: a larger value could never be used at the default
    max_sweep_points: int = 64
    max_streams: int = 1000  # concurrent StreamMetrics calls of the whole server
    max_string_length: int = 256  # names, ids and option values in requests

    # Service-side training defaults, filled into a job's spec when the request leaves them
    # unset (ssdrbm_server/resolver.py); the model-side ones (step sizes, batch size, CD steps,
    # AIS settings, backoff) are ssdcore's, so the library and the service agree
    default_steps: int = 1000  # when the request gives neither steps nor epochs
    default_eval_every: int = 100  # steps between metric events
    default_checkpoint_every: int = 500  # steps between checkpoints
    default_validation_fraction: float = 0.1
    max_total_steps: int = 10_000_000  # refuse jobs that would never end
    max_full_variance_visibles: int = 256  # a full precision matrix is V×V and O(V³) per step
    # Budgets checked on submit, before anything is allocated (resolver.py, RESOURCE_EXHAUSTED):
    # an upload's width is otherwise unbounded, and V·H alone sizes the model and every step.
    max_visibles: int = 1 << 16  # dataset width (n_visible); MNIST is 784
    max_model_bytes: int = 256 * 1024 * 1024  # float32 parameters; serving caches whole models
    # Redis's proto-max-bulk-len: the largest value it stores; a checkpoint's trainer state
    # (parameters, optimizer buffers, PCD chains) is one value, so a bigger one never saves
    max_value_bytes: int = 512 * 1024 * 1024
    # ≈ 2·B·V·H·(2·cd_k+2) per training step; 1e11 admits 784×2000, CD-10, batch 1000 (6.9e10)
    max_step_flops: int = 100_000_000_000
    # AIS per evaluation ≈ 2·chains·betas·V·H; 1e12 admits the defaults (100×1000) at 784×2000
    max_eval_flops: int = 1_000_000_000_000
    # Serving, checked before computing: output elements of one Reconstruct (B·V·k) or
    # SampleHidden (B·H) call; 16 Mi floats = 64 MiB, the largest message
    max_serving_output_elements: int = 16 * 1024 * 1024
    serving_chunk_rows: int = 256  # rows per computed chunk; deadline and cancel checked between
    max_serving_calls_per_tenant: int = 4  # concurrent Reconstruct/SampleHidden of one tenant
    serving_wait_seconds: float = 1.0  # a call over that cap waits this long for a slot
    max_streams_per_tenant: int = 100  # concurrent StreamMetrics calls of one tenant
    # The HTTP front (http_front.py), against slow and hostile clients: a connection is closed
    # that has not sent its headers, then its whole body, within these times
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 60.0  # 16 MiB at about 300 KB/s
    # One request body, refused (413) from Content-Length before it is read, or as soon as a
    # chunked body passes it. JSON costs ~10x raw bytes per number and its parse is larger
    # still, so this sits below max_message_bytes: bigger batches go over gRPC, raw contents
    http_max_body_bytes: int = 16 * 1024 * 1024
    # Open connections; one more is answered 503 and closed as it opens
    http_max_connections: int = 512
    # Requests being handled at once, counted after authentication, so unauthenticated clients
    # never take a tenant's slot: for the server (bounds the bodies held and parsed together: at
    # most 32 x 16 MiB, and a 16 MiB body's parse peaks near 50 MiB) and for one tenant (its
    # share, so one tenant's slow uploads leave the others room); over either, 429 at once
    http_max_requests: int = 32
    http_max_requests_per_tenant: int = 8

    # Serving
    serving_threads: int = 4  # thread pool for Reconstruct / SampleHidden (torch frees the GIL)
    model_cache_size: int = 32  # models kept in memory, keyed by job id and checkpoint step

    # Shutdown and streaming
    shutdown_grace_s: float = 10.0  # in-flight RPCs get this long after SIGTERM
    stream_block_ms: int = 1000  # XREAD BLOCK per poll when following a metric stream
    # Events queued for one live StreamMetrics subscriber; one further behind stops sharing the
    # job's follower and reads Redis itself from its last token (bounds memory per slow client)
    stream_buffer_events: int = 1024

    # Worker in the same process (`python -m ssdrbm_server`); 0 for API-only nodes
    run_worker: bool = True
    # CPU lists (`0-3,8`) that keep serving and training off each other's cores on a shared
    # host (ssdrbm_server/cpus.py); empty: no pinning
    serving_cpus: str = ""
    training_cpus: str = ""
    worker_id: str = ""  # empty: derived from host name and process id
    # Training processes one worker runs at once, each slot a worker of its own on its own share
    # of the training CPUs; 0: derived from the machine, 1 with a GPU (worker/slots.py)
    worker_slots: int = 0
    lease_seconds: float = 10.0  # a dead worker's job is taken over this long after it died
    # lease renewal and cancel check while a job trains: a cancel lands within about this long
    heartbeat_seconds: float = 0.5
    worker_poll_ms: int = 500  # blocking queue read; bounds how long a stop waits for the loop
    # A graceful stop waits this long for the checkpoint and its Redis writes; then the job is
    # left to its lease and resumed elsewhere from its last checkpoint: a stop always ends
    stop_timeout_seconds: float = 60.0
    # Touched every heartbeat by a running worker (healthcheck --worker, readiness.py); "": none
    worker_heartbeat_file: str = ""
    # A training process silent this long is taken for hung, killed and its job retried. It
    # beats between chunks of at most 10 steps and around each evaluation, so this must cover
    # the longest of those: the largest AIS estimate a job may ask for (about 1e12 FLOPs)
    # takes a minute or two on one slow CPU core; 5 minutes leaves room for that
    child_heartbeat_timeout_seconds: float = 300.0
    # A job whose training process dies (e.g. the OOM killer's SIGKILL) or hangs this many times
    # ends FAILED: a one-off crash is retried, a job that kills its process every time is not
    max_training_process_failures: int = 3
    # A job (or pack) holds its worker this long at most while other work waits; then it is
    # checkpointed and put back at the front of its tenant's queue (worker/runner.py)
    slice_seconds: float = 60.0
    # Jobs of one pack key trained as one batched computation (worker/pack_claim.py). 32: on the
    # CPU a 32-run pack of small models costs a few solo steps per step; 1: no packing
    max_pack_size: int = 32
    # Memory of one pack's runs, summed (each run's estimate as training_memory_mb's, without
    # the process itself): a pack stops growing here, so packing never needs a bigger worker
    pack_memory_mb: int = 4096
    checkpoint_keep: int = 3  # checkpoints kept per job: the newest and older ones to fall back on
    # Lifecycle (ssdrbm_server/store/lifecycle.py): a finished job keeps its newest checkpoints
    # only (at least 1, which serving and export use); its StartTraining request_id is
    # remembered this long (a retry after that creates a new job); finished jobs are deleted
    # this long after their end (0 keeps them until DeleteJob)
    finished_checkpoints_kept: int = 1
    idempotency_ttl_seconds: int = 24 * 3600
    finished_job_ttl_seconds: int = 0
    # Job records (any state) of one tenant; past it StartTraining asks to delete finished jobs
    max_job_records_per_tenant: int = 10_000
    # Run even though Redis keeps no append-only file or leaves its fsync to the OS: development
    # and tests only, warned every minute (redis_checks.py); eviction is never allowed
    allow_no_persistence: bool = False
    # How often the API and every worker check those settings again (CONFIG SET changes them)
    redis_check_interval_s: float = 30.0
    # CPU threads of each training process; 0: its slot's share of the CPUs with several slots
    # (worker/slots.py), torch's default with one
    torch_threads: int = 0

    # Authentication: "none" (development, tenant "default") or "token" (bearer tokens)
    auth_mode: str = "none"
    auth_tokens_file: str = ""  # lines "token tenant" (or JSON {"token": "tenant"})
    auth_tokens: str = ""  # inline "token1=tenant1,token2=tenant2", for tests and small setups
    # Allow auth_mode "none" on a non-loopback address (only trusted machines can reach it),
    # warned every minute (exposure.py)
    allow_unauthenticated_remote: bool = False
    # Tokens over plaintext on a non-loopback address are refused unless this is set (a proxy in
    # front terminates TLS): anyone on the path could read them
    allow_plaintext_tokens: bool = False

    # TLS for the gRPC listener; empty = plaintext
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""  # set to require client certificates (mTLS)
    # The CA that signed tls_cert_file, for clients on this host that verify the server (the
    # health probe); empty: tls_cert_file itself is trusted, right for a self-signed one
    tls_ca_file: str = ""

    log_level: str = "INFO"
    log_format: str = "text"  # "json": one JSON object per line (ssdrbm_server/logs.py)
    # OpenTelemetry spans: "off", "console" (stdout) or "otlp" (OTEL_EXPORTER_OTLP_* variables);
    # needs the tracing extra (ssdrbm_server/tracing.py)
    tracing: str = "off"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``SSDRBM_<FIELD>`` variables (upper case), then keyword overrides."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f.name, f.type, raw)
        values.update(overrides)
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ConfigError for values that would only fail later and less clearly."""
        if self.auth_mode not in ("none", "token"):
            raise ConfigError(f"SSDRBM_AUTH_MODE must be 'none' or 'token', not {self.auth_mode!r}")
        ports = (("http_port", "the HTTP front"), ("worker_metrics_port", "the endpoint"))
        for name, what in ports:
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(
                    f"SSDRBM_{name.upper()} must be a TCP port (0 turns {what} off), not {port}"
                )
        for name in ("http_header_timeout_s", "http_body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"SSDRBM_{name.upper()} must be above 0 (seconds)")
        if self.log_format not in ("text", "json"):
            raise ConfigError(
                f"SSDRBM_LOG_FORMAT must be 'text' or 'json', not {self.log_format!r}"
            )
        if self.tracing not in ("off", "console", "otlp"):
            raise ConfigError(
                f"SSDRBM_TRACING must be 'off', 'console' or 'otlp', not {self.tracing!r}"
            )
        positive = [
            "max_message_bytes",
            "max_tensor_elements",
            "max_dataset_bytes",
            "max_dataset_bytes_per_tenant",
            "max_concurrent_uploads",
            "max_uploads_per_tenant",
            "dataset_chunk_bytes",
            "redis_connections",
            "max_jobs_per_tenant",
            "max_sweep_points",
            "max_streams",
            "max_streams_per_tenant",
            "http_max_body_bytes",
            "http_max_connections",
            "http_max_requests",
            "http_max_requests_per_tenant",
            "max_visibles",
            "max_model_bytes",
            "max_value_bytes",
            "max_step_flops",
            "max_eval_flops",
            "max_serving_output_elements",
            "serving_chunk_rows",
            "max_serving_calls_per_tenant",
            "stream_buffer_events",
            "max_string_length",
            "default_steps",
            "default_eval_every",
            "default_checkpoint_every",
            "serving_threads",
            "model_cache_size",
            "worker_poll_ms",
            "finished_checkpoints_kept",
            "max_job_records_per_tenant",
            "max_pack_size",
            "pack_memory_mb",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"SSDRBM_{name.upper()} must be at least 1")
        if self.lease_seconds <= 2 * self.heartbeat_seconds:
            raise ConfigError(
                f"SSDRBM_LEASE_SECONDS ({self.lease_seconds}) must exceed twice "
                f"SSDRBM_HEARTBEAT_SECONDS ({self.heartbeat_seconds}), or a healthy worker would "
                "lose its lease"
            )
        if self.dataset_chunk_bytes % 8:
            raise ConfigError(
                f"SSDRBM_DATASET_CHUNK_BYTES ({self.dataset_chunk_bytes}) must be a multiple of 8, "
                "so no array element straddles two chunks"
            )
        if self.redis_check_interval_s <= 0:
            raise ConfigError(
                "SSDRBM_REDIS_CHECK_INTERVAL_S must be above 0 (seconds between checks of "
                f"Redis's persistence settings), not {self.redis_check_interval_s}"
            )
        if self.upload_idle_seconds <= 0:
            raise ConfigError("SSDRBM_UPLOAD_IDLE_SECONDS must be positive")
        if self.child_heartbeat_timeout_seconds <= 0:
            raise ConfigError(
                "SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS must be above 0, not "
                f"{self.child_heartbeat_timeout_seconds}"
            )
        if self.slice_seconds <= 0:
            raise ConfigError(
                "SSDRBM_SLICE_SECONDS must be above 0 (seconds a job holds its worker while "
                f"other work waits), not {self.slice_seconds}"
            )
        if self.worker_slots < 0:
            raise ConfigError(
                "SSDRBM_WORKER_SLOTS must be 0 (derived from the machine) or more, not "
                f"{self.worker_slots}"
            )
        if self.max_training_process_failures < 1:
            raise ConfigError(
                "SSDRBM_MAX_TRAINING_PROCESS_FAILURES must be at least 1 (1: fail on the first "
                f"crash), not {self.max_training_process_failures}"
            )
        for name in ("idempotency_ttl_seconds", "finished_job_ttl_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"SSDRBM_{name.upper()} must be 0 or more")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("set both SSDRBM_TLS_CERT_FILE and SSDRBM_TLS_KEY_FILE, or neither")
        for name in ("serving_cpus", "training_cpus"):
            _check_cpu_list(name, getattr(self, name))

    @property
    def serving_cpu_set(self) -> frozenset[int]:
        return parse_cpu_list(self.serving_cpus)

    @property
    def training_cpu_set(self) -> frozenset[int]:
        return parse_cpu_list(self.training_cpus)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed (tests use it to lower limits)."""
        return dataclasses.replace(self, **changes)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse(name: str, type_name: Any, raw: str) -> Any:
    # With `from __future__ import annotations`, dataclass field types are strings.
    kind = type_name if isinstance(type_name, str) else type_name.__name__
    env_name = ENV_PREFIX + name.upper()
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{env_name} must be a {kind}, not {raw!r}") from None
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ConfigError(f"{env_name} must be true or false, not {raw!r}")
    return raw


def field_names() -> list[str]:
    """Names of all settings (documentation and tests)."""
    return [f.name for f in dataclasses.fields(Settings)]


def _check_cpu_list(name: str, text: str) -> None:
    variable = f"{ENV_PREFIX}{name.upper()}"
    try:
        cpus = parse_cpu_list(text)
    except ValueError as exc:
        raise ConfigError(f"{variable}: {exc}") from None
    missing = beyond_host(cpus)
    if missing:
        count = os.cpu_count() or 1
        raise ConfigError(
            f"{variable} names CPUs {missing} but this host has {count} (0-{count - 1})"
        )
