"""Deployment files and the process entry points.

- docker-compose.yml: Redis with AOF and a health check, the gRPC port published on the host's
  loopback only (auth is off there), workers; the image alone refuses to serve without auth.
- Dockerfile: installs the same packages as scripts/install, torch at the pinned version.
- ``python -m ssdrbm_server``: starts, reports SERVING to
  ``python -m ssdrbm_server.healthcheck``, serves Prometheus metrics, and on SIGTERM shuts down
  gracefully with exit code 0.
- Health checks: the API's is the readiness probe, a worker's its own heartbeat probe, the
  GPU worker reserves an NVIDIA GPU under the ``gpu`` profile; images are pinned releases.
- deploy/kubernetes: every manifest valid for Kubernetes ``K8S_VERSION`` (kubernetes-validate's
  offline schemas, strict), and consistent with the server: probes ask for the health entries
  it registers, every SSDRBM_* name is a setting, the settings as deployed pass the start checks,
  ports, images, Secrets and grace periods agree.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.request
from importlib.util import find_spec

import grpc
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from ssdrbm import __version__
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server import catalog
from ssdrbm_server.config import ConfigError, Settings, field_names
from ssdrbm_server.exposure import check_exposure
from ssdrbm_server.healthcheck import check
from ssdrbm_server.healthcheck import parser as healthcheck_parser
from ssdrbm_server.readiness import LIVENESS, READINESS
from tests.fixtures.redis import free_port
from tests.fixtures.server_process import ROOT, python_m_server, stop_gracefully, wait_until


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def dockerfile() -> str:
    # Join continuation lines so each instruction is one line.
    return (ROOT / "Dockerfile").read_text().replace("\\\n", " ")


def pip_targets(text: str) -> set[str]:
    """Local packages that `pip install` lines install, without -e and [extras]."""
    targets: set[str] = set()
    for line in text.splitlines():
        if "pip install" not in line or line.lstrip().startswith("#"):
            continue
        words = shlex.split(line.split("pip install", 1)[1].split("&&")[0], comments=True)
        for word in words:
            word = word.strip("'\"")
            if word.startswith(".") and not word.startswith("--"):
                targets.add(re.sub(r"\[.*\]$", "", word).rstrip("/") or ".")
    return targets


def test_compose_runs_redis_with_aof_and_health_checks() -> None:
    services = compose()["services"]
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert any(volume.endswith(":/data") for volume in redis["volumes"])


def test_compose_publishes_grpc_and_checks_its_health() -> None:
    services = compose()["services"]
    api = services["ssdrbm"]
    assert "127.0.0.1:50051:50051" in api["ports"]
    assert api["command"] == ["python", "-m", "ssdrbm_server"]
    assert "ssdrbm_server.healthcheck" in api["healthcheck"]["test"]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    worker = services["worker"]
    assert worker["command"] == ["python", "-m", "ssdrbm_server.worker"]
    assert worker["deploy"]["replicas"] >= 1
    for service in (api, worker):
        assert service["environment"]["SSDRBM_REDIS_URL"] == "redis://redis:6379/0"


def image_environment() -> dict[str, str]:
    """The SSDRBM_* variables the Dockerfile's ENV sets."""
    env_lines = re.findall(r"^ENV (.*)$", dockerfile(), re.MULTILINE)
    return dict(re.findall(r"(SSDRBM_\w+)=(\S+)", " ".join(env_lines)))


def test_compose_publishes_without_auth_on_the_host_loopback_only() -> None:
    """Auth is off in the development stack: every published port is bound to 127.0.0.1, and
    the server is told explicitly that it may listen on 0.0.0.0 inside its container."""
    api = compose()["services"]["ssdrbm"]
    environment = api["environment"]
    assert environment.get("SSDRBM_AUTH_MODE", "none") == "none"
    assert environment["SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE"] == "1"
    for port in api["ports"]:
        assert port.startswith("127.0.0.1:"), f"{port} is published on every host address"
    settings = Settings.from_env({**image_environment(), **environment})
    check_exposure(settings)  # starts as composed


def test_image_alone_refuses_to_serve_unauthenticated_on_every_address() -> None:
    image = image_environment()
    assert image["SSDRBM_LISTEN_ADDRESS"].startswith("0.0.0.0:")  # reachable in a container
    with pytest.raises(ConfigError, match="SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE"):
        check_exposure(Settings.from_env(image))
    tokens = {**image, "SSDRBM_AUTH_MODE": "token", "SSDRBM_AUTH_TOKENS": "t=alice"}
    with pytest.raises(ConfigError, match="SSDRBM_TLS_CERT_FILE"):
        check_exposure(Settings.from_env(tokens))  # tokens, but in plaintext
    check_exposure(Settings.from_env({**tokens, "SSDRBM_ALLOW_PLAINTEXT_TOKENS": "1"}))


def test_python_m_server_refuses_a_remote_address_without_auth(redis_url: str) -> None:
    with python_m_server(redis_url, free_port(), listen_address="0.0.0.0:0") as process:
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert "SSDRBM_LISTEN_ADDRESS=0.0.0.0:0 is not a loopback address" in output
    assert "SSDRBM_AUTH_MODE=token" in output and "SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE=1" in output


def test_compose_commands_name_modules_that_exist() -> None:
    for module in ("ssdrbm_server", "ssdrbm_server.healthcheck", "ssdrbm_server.worker"):
        assert find_spec(module) is not None, module


def test_dockerfile_installs_what_scripts_install_installs() -> None:
    install = (ROOT / "scripts" / "install").read_text()
    docker = dockerfile()
    assert pip_targets(docker) == pip_targets(install) == {".", "./client", "./server"}
    # Every folder the installed packages need is copied into the image, and the one VERSION
    # file that all three distributions read (client/ and server/ link to it).
    assert re.search(r"^COPY .*\bVERSION\b.* \./$", docker, re.MULTILINE)
    for folder in ("client/", "ssdcore/", "server/"):
        assert re.search(rf"^COPY {folder} ", docker, re.MULTILINE), folder


def test_dockerfile_pins_the_same_torch_and_runs_the_server() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pinned = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    docker = dockerfile()
    version = re.search(r"^ARG TORCH_VERSION=(\S+)", docker, re.MULTILINE).group(1)
    assert pinned == f"torch=={version}"
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11", docker, re.MULTILINE)
    assert re.search(r'^CMD \["python", "-m", "ssdrbm_server"\]', docker, re.MULTILINE)
    assert "ssdrbm_server.healthcheck" in re.search(r"^HEALTHCHECK .*", docker, re.MULTILINE).group(
        0
    )


def test_python_m_server_serves_and_stops_gracefully_on_sigterm(redis_url: str) -> None:
    port, metrics_port = free_port(), free_port()
    with python_m_server(
        redis_url,
        port,
        metrics_port=str(metrics_port),
        metrics_address="127.0.0.1",
        run_worker="0",
    ) as process:
        wait_until(process, lambda: check(f"127.0.0.1:{port}", timeout_s=1.0), "the server serving")
        healthcheck = subprocess.run(
            [sys.executable, "-m", "ssdrbm_server.healthcheck", f"127.0.0.1:{port}"],
            cwd=ROOT,
            timeout=30,
        )
        assert healthcheck.returncode == 0
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rbm_pb2_grpc.RBMServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetJob(rbm_pb2.GetJobRequest(job_id="0" * 32), timeout=10)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            exposition = response.read().decode()
        assert 'ssdrbm_rpc_latency_seconds_count{code="NOT_FOUND",method="GetJob"} 1.0' in (
            exposition
        )
        assert 'ssdrbm_jobs{state="QUEUED"}' in exposition
        output = stop_gracefully(process)
    assert process.returncode == 0, output
    assert "AUTHENTICATION IS OFF" in output  # the no-auth mode is announced loudly
    assert "shutting down" in output and "gRPC server stopped" in output
    assert not check(f"127.0.0.1:{port}", timeout_s=1.0)


@pytest.mark.parametrize("target", ["127.0.0.1:1"])
def test_healthcheck_fails_when_nothing_listens(target: str) -> None:
    assert not check(target, timeout_s=1.0)


# --- health checks, GPU worker and pinned images in compose and the Dockerfile ---------------

HEALTHCHECK_COMMAND = ["python", "-m", "ssdrbm_server.healthcheck"]


def probe_args(command: list[str]) -> argparse.Namespace:
    """A probe command (``CMD``/exec form) parsed as the probe itself parses it."""
    start = command.index("ssdrbm_server.healthcheck")
    assert command[: start + 1] == HEALTHCHECK_COMMAND, command
    return healthcheck_parser().parse_args(command[start + 1 :])


def probed_entry(args: argparse.Namespace) -> str:
    """What a parsed probe checks: a health entry, or "worker" for the heartbeat file."""
    if args.worker:
        return "worker"
    return args.service if args.service is not None else LIVENESS if args.live else READINESS


def compose_settings(name: str) -> Settings:
    """The settings a compose service's process runs with (the image's ENV, then compose's)."""
    environment = compose()["services"][name]["environment"]
    return Settings.from_env({**image_environment(), **environment})


def test_compose_api_and_workers_have_their_own_health_checks() -> None:
    services = compose()["services"]
    assert probed_entry(probe_args(services["ssdrbm"]["healthcheck"]["test"][1:])) == READINESS
    for name in ("worker", "worker-gpu"):
        assert probed_entry(probe_args(services[name]["healthcheck"]["test"][1:])) == "worker"
        # The heartbeat file the probe reads is one the worker writes (set in the image).
        assert compose_settings(name).worker_heartbeat_file.startswith("/tmp/")


def test_compose_gpu_worker_reserves_an_nvidia_gpu_under_its_profile() -> None:
    gpu = compose()["services"]["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["command"] == ["python", "-m", "ssdrbm_server.worker"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1
    assert device["capabilities"] == ["gpu"]
    assert gpu["environment"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert "/whl/cu" in gpu["build"]["args"]["TORCH_INDEX_URL"]  # torch's CUDA wheels
    assert gpu["image"].split(":")[0] == "ssdrbm-cuda"


def test_images_are_pinned_releases() -> None:
    services = compose()["services"]
    assert re.fullmatch(
        r"redis:7\.\d+\.\d+(-alpine)?(@sha256:[0-9a-f]{64})?", services["redis"]["image"]
    )
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", dockerfile_base()), dockerfile_base()


def dockerfile_base() -> str:
    return re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile(), re.MULTILINE).group(1)


def test_compose_builds_each_image_once() -> None:
    services = compose()["services"]
    builders: dict[str, list[str]] = {}
    for name, service in services.items():
        if "build" in service:
            builders.setdefault(service["image"], []).append(name)
    assert builders == {"ssdrbm:local": ["ssdrbm"], "ssdrbm-cuda:local": ["worker-gpu"]}
    # The other services of the project run an image that one of them builds, or a released one.
    assert services["worker"]["image"] == "ssdrbm:local"
    assert "build" not in services["redis"]


def test_every_image_runs_one_python() -> None:
    # CPU and CUDA images alike start from the Dockerfile's pinned python:3.11 base (the CUDA
    # libraries come with torch's wheels), and nothing installs another interpreter.
    base = dockerfile_base()
    for name, service in compose()["services"].items():
        if "build" in service:
            assert service["build"]["args"].get("BASE_IMAGE", base) == base, name
    assert "apt-get install" not in dockerfile()
    assert re.search(r"^RUN python3 -m venv /opt/venv$", dockerfile(), re.MULTILINE)


def test_the_data_folder_is_documented_with_the_catalogs_file_names() -> None:
    expected = [f"mnist/{stem}" for stem in catalog.MNIST_IMAGE_FILES]
    expected += [f"freyface/{catalog.FREY_FACE_FILE}", "./data", "SSDRBM_DATA_DIR"]
    for document in ("docker-compose.yml", "docs/DEPLOY.md"):
        text = (ROOT / document).read_text()
        assert [name for name in expected if name not in text] == [], document


def test_compose_ports_and_grace_periods_follow_the_settings() -> None:
    services = compose()["services"]
    api = compose_settings("ssdrbm")
    published = {port.rsplit(":", 1)[1] for port in services["ssdrbm"]["ports"]}
    assert published == {
        api.listen_address.rsplit(":", 1)[1],
        str(api.metrics_port),
        str(api.http_port),
    }
    for name in ("ssdrbm", "worker", "worker-gpu"):
        grace_s = int(services[name]["stop_grace_period"].removesuffix("s"))
        assert grace_s > compose_settings(name).stop_timeout_seconds, name


def test_dockerfile_healthcheck_is_the_readiness_probe_from_the_environment() -> None:
    line = re.search(r"^HEALTHCHECK .*", dockerfile(), re.MULTILINE).group(0)
    command = json.loads(line.split("CMD", 1)[1])
    args = probe_args(command)
    assert probed_entry(args) == READINESS
    assert args.target is None  # the port of SSDRBM_LISTEN_ADDRESS, TLS from SSDRBM_TLS_*


# --- Kubernetes ------------------------------------------------------------------------------

K8S_VERSION = "1.30.0"  # the oldest release still maintained upstream; schemas ship offline
KUBERNETES = ROOT / "deploy" / "kubernetes"


def kustomization() -> dict:
    return yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())


def manifests() -> list[dict]:
    resources: list[dict] = []
    for name in kustomization()["resources"]:
        resources += [r for r in yaml.safe_load_all((KUBERNETES / name).read_text()) if r]
    return resources


def resource(kind: str, name: str) -> dict:
    return next(r for r in manifests() if r["kind"] == kind and r["metadata"]["name"] == name)


def workloads() -> list[dict]:
    return [r for r in manifests() if r["kind"] in ("Deployment", "StatefulSet")]


def ssdrbm_deployments() -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in manifests() if r["kind"] == "Deployment"}


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def deployed_environment(workload: dict) -> dict[str, str]:
    """The SSDRBM_* variables a container gets: the image's, the ConfigMaps', its own (values
    from Secrets read from those Secrets)."""
    environment = dict(image_environment())
    spec = container(workload)
    for source in spec.get("envFrom", []):
        environment.update(resource("ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in spec.get("env", []):
        if "value" in variable:
            environment[variable["name"]] = variable["value"]
        else:
            ref = variable["valueFrom"]["secretKeyRef"]
            secret = resource("Secret", ref["name"])
            environment[variable["name"]] = secret["stringData"][ref["key"]]
    return environment


def test_kubernetes_manifests_are_valid() -> None:
    version = kubernetes_validate.utils.major_minor(K8S_VERSION)
    assert version in {
        kubernetes_validate.utils.major_minor(v) for v in kubernetes_validate.utils.all_versions()
    }
    for manifest in manifests():
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    component = yaml.safe_load((KUBERNETES / "external-redis" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    for patch in component["patches"]:
        body = yaml.safe_load(patch["patch"])
        if body.pop("$patch", None) == "delete":  # it removes what the base has
            assert resource(body["kind"], body["metadata"]["name"])
        else:
            kubernetes_validate.validate(body, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) == files
    tags = {image["name"]: image["newTag"] for image in kustomization()["images"]}
    assert tags == {"ssdrbm": __version__, "ssdrbm-cuda": __version__}
    for workload in ssdrbm_deployments().values():
        repository, tag = container(workload)["image"].split(":")
        assert tag == __version__ and repository in tags
    # The same Redis release as compose.
    redis_image = container(resource("StatefulSet", "redis"))["image"]
    assert redis_image == compose()["services"]["redis"]["image"]


def test_kubernetes_probes_ask_for_the_entries_the_server_registers() -> None:
    registered = {LIVENESS, READINESS}
    expected = {
        "ssdrbm-api": {
            "startupProbe": LIVENESS,
            "readinessProbe": READINESS,
            "livenessProbe": LIVENESS,
        },
        "ssdrbm-worker": {"livenessProbe": "worker"},
        "ssdrbm-worker-gpu": {"livenessProbe": "worker"},
    }
    for name, probes in expected.items():
        spec = container(ssdrbm_deployments()[name])
        for probe_name, entry in probes.items():
            probe = spec[probe_name]
            if "grpc" in probe:  # Kubernetes' own gRPC probe, by entry name
                assert probe["grpc"]["service"] in registered and probe["grpc"]["service"] == entry
            else:
                assert probed_entry(probe_args(probe["exec"]["command"])) == entry, (name, probe)
        assert set(probes) == {p for p in spec if p.endswith("Probe")}, name


def test_kubernetes_environment_names_are_settings() -> None:
    names = {f"SSDRBM_{field.upper()}" for field in field_names()}
    used: set[str] = set()
    for manifest in manifests():
        if manifest["kind"] == "ConfigMap":
            used |= set(manifest["data"])
    for workload in ssdrbm_deployments().values():
        used |= {v["name"] for v in container(workload).get("env", [])}
    for service in compose()["services"].values():
        used |= set(service.get("environment", {}))
    used |= set(image_environment())
    ours = {name for name in used if name.startswith("SSDRBM_")}
    assert ours - names == set()


def test_kubernetes_settings_pass_the_start_checks_and_match_ports_and_mounts() -> None:
    for name, workload in ssdrbm_deployments().items():
        environment = deployed_environment(workload)
        settings = Settings.from_env(environment)
        spec = container(workload)
        pod = workload["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in spec.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod["volumes"]}
        # Files the settings name lie in a mounted Secret that holds that key.
        files = [
            settings.auth_tokens_file,
            settings.tls_cert_file,
            settings.tls_key_file,
            settings.tls_ca_file,
        ]
        if name == "ssdrbm-api":
            check_exposure(settings)  # tokens and TLS: it starts on 0.0.0.0
            ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
            assert ports == {
                "grpc": int(settings.listen_address.rsplit(":", 1)[1]),
                "metrics": settings.metrics_port,
                "http": settings.http_port,
            }
            assert not settings.run_worker
            for path in files:
                directory, key = path.rsplit("/", 1)
                secret = resource("Secret", volumes[mounts[directory]]["secret"]["secretName"])
                assert key in secret["stringData"], path
            grace = settings.shutdown_grace_s
        else:
            assert spec["command"] == ["python", "-m", "ssdrbm_server.worker"]
            ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
            assert ports == {"metrics": settings.worker_metrics_port}
            grace = settings.stop_timeout_seconds
        assert pod["terminationGracePeriodSeconds"] > grace, name
        # The heartbeat file (and anything else written) is on a writable volume.
        assert spec["securityContext"]["readOnlyRootFilesystem"]
        assert settings.worker_heartbeat_file.startswith("/tmp/") and "/tmp" in mounts
    service = resource("Service", "ssdrbm")
    api_ports = {p["name"] for p in container(resource("Deployment", "ssdrbm-api"))["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= api_ports


def test_kubernetes_workloads_are_bounded_and_run_as_non_root() -> None:
    for workload in workloads():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        spec = container(workload)
        assert spec["securityContext"]["allowPrivilegeEscalation"] is False
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(spec["resources"][bound]), workload["metadata"]["name"]
    gpu = container(resource("Deployment", "ssdrbm-worker-gpu"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    cpu = container(resource("Deployment", "ssdrbm-worker"))
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]


def test_kubernetes_redis_keeps_an_append_only_file_on_a_volume() -> None:
    redis_set = resource("StatefulSet", "redis")
    args = container(redis_set)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    (claim,) = redis_set["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container(redis_set)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == args[args.index("--dir") + 1]
    host = Settings.from_env(deployed_environment(resource("Deployment", "ssdrbm-api"))).redis_url
    assert host.startswith(f"redis://{redis_set['spec']['serviceName']}:")
