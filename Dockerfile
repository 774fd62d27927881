# ssdrbm: the gRPC training service and its worker in one image.
#
#   docker build -t ssdrbm .                                  # CPU (default)
#   docker build -t ssdrbm-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# `python -m ssdrbm_server` runs the gRPC server with a worker (SSDRBM_RUN_WORKER=0 for API only);
# `python -m ssdrbm_server.worker` runs a worker alone. Configuration: SSDRBM_* environment variables
# (server/ssdrbm_server/config.py). Real datasets are read from SSDRBM_DATA_DIR (mount them at /data).
#
# A container is only reachable on 0.0.0.0, so the image listens there, and the server then
# refuses to start until it is told who may call it: SSDRBM_AUTH_MODE=token with
# SSDRBM_AUTH_TOKENS_FILE (and SSDRBM_TLS_CERT_FILE / SSDRBM_TLS_KEY_FILE, or
# SSDRBM_ALLOW_PLAINTEXT_TOKENS=1 behind a TLS-terminating proxy), or
# SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE=1 when only trusted machines reach the published ports
# (docker-compose.yml publishes them on the host's loopback and sets it).
# A patch release, so a rebuild gets the same interpreter. The CUDA image has the same base, so
# both run Python 3.11: torch's CUDA wheels (the cu128 index) carry their own CUDA and cuDNN
# libraries, and the NVIDIA Container Toolkit mounts the host's driver, so no nvidia/cuda base
# is needed (those come without Python, and their Ubuntu has 3.10 or 3.12, not 3.11).
ARG BASE_IMAGE=python:3.11.11-slim-bookworm
FROM ${BASE_IMAGE}

# The CPU wheel index keeps the image small; a CUDA build passes a CUDA wheel index (cu128).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SSDRBM_LISTEN_ADDRESS=0.0.0.0:50051 \
    SSDRBM_METRICS_ADDRESS=0.0.0.0 \
    SSDRBM_METRICS_PORT=9108 \
    SSDRBM_HTTP_ADDRESS=0.0.0.0 \
    SSDRBM_HTTP_PORT=8080 \
    SSDRBM_DATA_DIR=/data \
    SSDRBM_WORKER_HEARTBEAT_FILE=/tmp/ssdrbm-worker.alive

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
# torch first, from the chosen index, at the version pyproject.toml pins.
RUN python -m pip install -q "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The three distributions of the checkout, as scripts/install installs them (there editable): the
# core library (the root), the client (client/) and the service (server/), which needs both.
COPY pyproject.toml README.md LICENSE VERSION ./
COPY ssdcore/ ssdcore/
COPY client/ client/
COPY server/ server/
RUN python -m pip install -q . ./client ./server

RUN useradd --create-home --uid 10001 ssdrbm && mkdir -p /data && chown ssdrbm /data
USER ssdrbm

EXPOSE 50051 9108 8080
# Readiness (Redis answers, the worker runs) on SSDRBM_LISTEN_ADDRESS's port, over TLS when
# SSDRBM_TLS_CERT_FILE is set (SSDRBM_TLS_CA_FILE names its CA). A worker-only container
# (`python -m ssdrbm_server.worker`) is checked with `python -m ssdrbm_server.healthcheck --worker`.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "ssdrbm_server.healthcheck", "--ready"]
# SIGTERM starts the graceful shutdown (health NOT_SERVING, worker checkpoints, drain, stop).
STOPSIGNAL SIGTERM
CMD ["python", "-m", "ssdrbm_server"]
