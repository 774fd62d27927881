"""Bound before you expand: every numeric field of every request, at its extremes, is answered
at once by the real service in a process of its own, and what a request's numbers say never
grows the service's memory.

The API runs as `python -m ssdrbm_server` (no worker) against a redis-server of this module, so
its resident memory (/proc/<pid>/status VmRSS, and VmHWM, its peak) is the API's alone. A
property-based test walks the request messages' descriptors for every numeric field (scalars,
enums, repeated numbers, repeated messages and maps), sets one to an extreme value or a huge
list within the message size limit on an otherwise valid request, and checks the answer: OK,
INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the field (NOT_FOUND for a checkpoint step no
checkpoint has), within ANSWER_S. Over requests of ordinary size the API's peak memory stays
flat; over huge lists it is reported, not asserted (see the test).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ssdrbm.inference.v2 import open_inference_pb2 as oip
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from ssdrbm_server.config import Settings
from ssdrbm_server.errors import InvalidArgumentError, ResourceExhaustedError
from ssdrbm_server.handlers import INFERENCE_SERVICE_NAME
from ssdrbm_server.healthcheck import check
from ssdrbm_server.request_bounds import check_sweep, sweep_points
from tests.fixtures.jobs import N_VISIBLE, finish_with_checkpoint, tiny_request
from tests.fixtures.redis import RedisServer, free_port
from tests.fixtures.server_process import python_m_server, wait_until

ANSWER_S = 2.0  # every answer, refusals included; generous for a loaded 2-core machine
MESSAGE_BYTES = 4 * 1024 * 1024  # the API's message limit here: huge lists stay within it
HUGE = 300_000  # entries of a huge repeated field: under MESSAGE_BYTES at up to 10 bytes each
HUGE_MESSAGES = 100_000  # entries of a repeated message field or map (a few bytes each)
MIB = 1024 * 1024
# The API's peak memory (VmHWM) over requests of ordinary size, once first uses have loaded
# what they load: flat, whatever their numbers say.
FLAT_BYTES = 4 * MIB
# ... and over requests holding huge lists, each up to MESSAGE_BYTES on the wire and several
# times that parsed: what stays (VmRSS) is a few messages' worth and the peak (VmHWM) what
# parsing one takes (measured: +4 to +48 MiB kept, +33 to +58 MiB peak over 300 requests: the
# allocator's arenas of gRPC's threads keep what they like); a refused request kept until a
# full garbage collection would add hundreds of MiB, which these bounds still catch.
HUGE_KEPT_BYTES = 32 * MESSAGE_BYTES
HUGE_PEAK_BYTES = 32 * MESSAGE_BYTES
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


# --- the arithmetic, without a service ---------------------------------------------------------


def test_a_sweeps_points_are_counted_without_building_them() -> None:
    grid = pb.StartSweepRequest(
        axes=[
            pb.SweepAxis(field="optimizer.lr", values=[0.1, 0.2, 0.3]),
            pb.SweepAxis(field="optimizer.kind", kinds=[pb.OPTIMIZER_KIND_SGD] * 2),
        ],
        seeds=5,
    )
    assert sweep_points(grid) == (30, [("axes[0].values", 3), ("axes[1].kinds", 2), ("seeds", 5)])
    random = pb.StartSweepRequest(mode=pb.SWEEP_MODE_RANDOM, samples=7, seeds=2**31)
    assert sweep_points(random)[0] == 7
    limits = Settings(max_sweep_points=64)
    started = time.perf_counter()
    for request, field in [
        (pb.StartSweepRequest(seeds=2**32 - 1), "seeds: 4294967295 seeds"),
        (random, "seeds: 2147483648 seeds"),
        (pb.StartSweepRequest(mode=pb.SWEEP_MODE_RANDOM, samples=2**32 - 1), "samples:"),
        (pb.StartSweepRequest(axes=grid.axes, seeds=64), "axes[0].values × axes[1].kinds × seeds"),
    ]:
        with pytest.raises(ResourceExhaustedError, match="SSDRBM_MAX_SWEEP_POINTS") as caught:
            check_sweep(request, limits)
        assert caught.value.message.startswith(field), caught.value.message
        assert caught.value.limit == "max_sweep_points"
    assert time.perf_counter() - started < 0.1  # nothing was built
    many_axes = pb.StartSweepRequest(axes=[pb.SweepAxis(field="optimizer.lr", values=[1])] * 17)
    with pytest.raises(InvalidArgumentError, match=r"^axes: has 17 entries; at most 16"):
        check_sweep(many_axes, limits)
    rungs = pb.StartSweepRequest(seeds=1, early_stopping=pb.EarlyStopping(rungs=range(1, 66)))
    with pytest.raises(InvalidArgumentError, match=r"^early_stopping\.rungs: has 65 entries"):
        check_sweep(rungs, limits)
    assert check_sweep(grid, limits) == 30


# --- the service in a process of its own -------------------------------------------------------


@dataclass
class Api:
    """The API process, its stubs and a job with a checkpoint to serve."""

    pid: int
    channel: grpc.Channel
    stub: rbm_pb2_grpc.RBMServiceStub
    job_id: str

    def memory(self) -> dict[str, int]:
        """VmRSS and VmHWM of the API process, in bytes."""
        values = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) * 1024
        return values

    def infer(self, request: oip.ModelInferRequest, timeout: float) -> oip.ModelInferResponse:
        call = self.channel.unary_unary(
            f"/{INFERENCE_SERVICE_NAME}/ModelInfer",
            request_serializer=oip.ModelInferRequest.SerializeToString,
            response_deserializer=oip.ModelInferResponse.FromString,
        )
        return call(request, timeout=timeout)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    redis_server = RedisServer(tmp_path_factory.mktemp("bounds-redis"))
    redis_server.start()
    port = free_port()
    try:
        with python_m_server(
            redis_server.url,
            port,
            run_worker="0",
            metrics_port="0",
            log_level="WARNING",  # its output goes to a pipe read only at the end
            max_message_bytes=str(MESSAGE_BYTES),
        ) as process:
            target = f"127.0.0.1:{port}"
            wait_until(process, lambda: check(target, timeout_s=1.0), "the API serving")
            options = [
                ("grpc.max_send_message_length", MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MESSAGE_BYTES),
            ]
            with grpc.insecure_channel(target, options=options) as channel:
                stub = rbm_pb2_grpc.RBMServiceStub(channel)
                job = stub.StartTraining(tiny_request(), timeout=30).job
                finish_with_checkpoint(redis_server.url, job.id)
                yield Api(process.pid, channel, stub, job.id)
    finally:
        redis_server.stop()


def _sweep(**fields: Any) -> pb.StartSweepRequest:
    return pb.StartSweepRequest(
        base=_sweep_base(),
        axes=[pb.SweepAxis(field="optimizer.lr", values=[0.01, 0.02])],
        validate_only=True,
        **fields,
    )


def _sweep_base() -> pb.StartTrainingRequest:
    """A run's request: eval.every left to the sweep, which picks a divisor of the rungs."""
    base = tiny_request(steps=20)
    base.eval.ClearField("every")
    return base


def _base_requests(job_id: str) -> dict[str, Message]:
    """A valid request of every method with numeric fields; nothing that creates anything."""
    training = tiny_request()
    training.validate_only = True
    rows = pb.Tensor(shape=[2, N_VISIBLE], data=b"\0" * (8 * N_VISIBLE))
    infer = oip.ModelInferRequest(model_name=job_id)
    infer.inputs.add(name="input", datatype="FP32", shape=[1, N_VISIBLE])
    infer.inputs[0].contents.fp32_contents.extend([0.5] * N_VISIBLE)
    infer.outputs.add(name="hidden_probs")
    infer.parameters["seed"].int64_param = 3
    return {
        "StartTraining": training,
        "StartSweep": _sweep(seeds=2, early_stopping=pb.EarlyStopping(rungs=[10])),
        "StartSweep(random)": pb.StartSweepRequest(
            base=_sweep_base(),
            axes=[pb.SweepAxis(field="optimizer.lr", range=pb.SweepRange(low=0.01, high=0.1))],
            mode=pb.SWEEP_MODE_RANDOM,
            samples=2,
            seed=1,
            validate_only=True,
        ),
        "Reconstruct": pb.ReconstructRequest(job_id=job_id, input=rows, k=1, seed=1),
        "SampleHidden": pb.SampleHiddenRequest(job_id=job_id, input=rows, seed=1),
        "ExportModel": pb.ExportModelRequest(job_id=job_id),
        "ListJobs": pb.ListJobsRequest(),
        "ListDatasets": pb.ListDatasetsRequest(),
        "ListSweeps": pb.ListSweepsRequest(),
        "UploadDataset": pb.UploadDatasetRequest(header=pb.DatasetHeader(shape=[4, 2])),
        "ModelInfer": infer,
    }


FieldPath = tuple[str | int, ...]
NUMERIC = {
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_FLOAT: "double",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_ENUM: "enum",
}
EXTREMES = {
    "uint32": [0, 1, 2**31, 2**32 - 1],
    "int32": [-(2**31), -1, 0, 1, 2**31 - 1],
    "uint64": [0, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1],
    "int64": [-(2**63), -1, 0, 1, 2**31, 2**32 - 1, 2**63 - 1],
    "enum": [-1, 0, 1, 2**31 - 1],
    "double": [0.0, -1.0, 1e-300, 1e308, float("inf"), float("-inf"), float("nan")],
}


@dataclass(frozen=True)
class Case:
    """One field of one method's request: a scalar, a repeated number, a repeated message or a
    map, at ``path`` (names and list indexes) in the request."""

    method: str
    path: FieldPath
    kind: str  # "scalar", "repeated", "messages" or "map"
    type: str  # a key of EXTREMES ("" for messages and maps)

    @property
    def name(self) -> str:
        """The field as the service names it: ``axes[0].values``, ``training.cd_k``."""
        text = ""
        for part in self.path:
            text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
        return text


def _cases(method: str, message: Message, path: FieldPath = ()) -> Iterator[Case]:
    for field in message.DESCRIPTOR.fields:
        here = (*path, field.name)
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            yield Case(method, here, "map", "")
        elif field.message_type is not None and field.is_repeated:
            yield Case(method, here, "messages", "")
            if len(value):
                yield from _cases(method, value[0], (*here, 0))
        elif field.message_type is not None:
            if field.message_type.full_name != "google.protobuf.Timestamp":
                yield from _cases(method, value, here)
        elif field.type in NUMERIC:
            kind = "repeated" if field.is_repeated else "scalar"
            yield Case(method, here, kind, NUMERIC[field.type])


def _all_cases(job_id: str) -> list[Case]:
    return [
        case
        for method, request in _base_requests(job_id).items()
        for case in _cases(method, request)
    ]


def _parent(message: Message, path: FieldPath) -> Any:
    for part in path[:-1]:
        message = message[part] if isinstance(part, int) else getattr(message, part)
    return message


def _mutated(base: Message, case: Case, value: Any, length: int) -> Message:
    request = type(base)()
    request.CopyFrom(base)
    parent, name = _parent(request, case.path), case.path[-1]
    target = getattr(parent, name)
    if case.kind == "scalar":
        setattr(parent, name, value)
    elif case.kind == "repeated":
        del target[:]
        target.extend([value] * length)
    elif case.kind == "messages":
        model = target[0] if len(target) else None
        del target[:]
        for _ in range(length):
            entry = target.add()
            if model is not None:
                entry.CopyFrom(model)
    else:  # a map: distinct keys, each with its value type's zero
        value_field = parent.DESCRIPTOR.fields_by_name[name].message_type.fields_by_name["value"]
        for index in range(length):
            if value_field.message_type is not None:
                target[f"k{index}"].SetInParent()  # a message entry is made by reading it
            else:
                target[f"k{index}"] = value_field.default_value
    return request


def _call(api: Api, method: str, request: Message) -> tuple[grpc.StatusCode, str]:
    """The call's status and message (a stream is drained)."""
    try:
        if method == "ModelInfer":
            api.infer(request, timeout=30)
        elif method == "UploadDataset":
            api.stub.UploadDataset(iter([request]), timeout=30)
        elif method == "ExportModel":
            list(api.stub.ExportModel(request, timeout=30))
        else:
            getattr(api.stub, method.split("(")[0])(request, timeout=30)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def _names_the_field(case: Case, details: str) -> bool:
    """The refusal names the field set (``base.training.cd_k``, ``seeds``) or the message that
    holds it (``training.parallel_tempering``, which it needs set up another way)."""
    leaf = [part for part in case.path if isinstance(part, str)][-1]
    held_by = [Case(case.method, case.path[:end], "", "").name for end in range(2, len(case.path))]
    return any(name in details for name in [leaf, *held_by])


@pytest.mark.parametrize("seeds", [2**31, 10**7])
def test_a_sweep_of_billions_of_seeds_is_refused_at_once_without_memory(
    api: Api, seeds: int
) -> None:
    api.stub.StartSweep(_sweep(seeds=2), timeout=30)  # warm: every import the sweep path needs
    before = api.memory()
    started = time.perf_counter()
    code, details = _call(api, "StartSweep", _sweep(seeds=seeds))
    elapsed = time.perf_counter() - started
    after = api.memory()
    print(f"\nseeds={seeds}: {code.name} in {elapsed * 1000:.1f} ms; API {before} -> {after}")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith(f"seeds: {seeds} seeds is over this server's limit"), details
    assert "SSDRBM_MAX_SWEEP_POINTS" in details
    assert elapsed < 1.0
    assert after["VmHWM"] - before["VmHWM"] < 4 * MIB
    assert after["VmRSS"] - before["VmRSS"] < 4 * MIB


def _check_answer(api: Api, bases: dict[str, Message], case: Case, value: Any, length: int) -> None:
    """The case's field at ``value`` (a list of ``length`` entries, cut to the message limit)
    is answered within ANSWER_S by OK, or by a refusal naming the field."""
    request = _mutated(bases[case.method], case, value, length)
    if request.ByteSize() > MESSAGE_BYTES * 0.9:  # huge, yet within the message limit
        length = int(length * MESSAGE_BYTES * 0.9 / request.ByteSize())
        request = _mutated(bases[case.method], case, value, length)
    started = time.perf_counter()
    code, details = _call(api, case.method, request)
    elapsed = time.perf_counter() - started
    assert elapsed < ANSWER_S, (case, value, length, code, details)
    if code == grpc.StatusCode.NOT_FOUND:
        assert "checkpoint" in case.name, (case, value, details)
        return
    assert code in ALLOWED, (case, value, length, code, details)
    if code != grpc.StatusCode.OK:
        assert _names_the_field(case, details), (case, value, length, details)


def _answered(api: Api, lengths: dict[str, list[int]]) -> Any:
    """The property over the cases of the kinds in ``lengths``: any of them at any extreme
    value, as a list of any of its kind's lengths, is answered at once (``_check_answer``)."""
    bases = _base_requests(api.job_id)
    cases = [case for case in _all_cases(api.job_id) if case.kind in lengths]

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(data=st.data())
    def answered(data: st.DataObject) -> None:
        case = data.draw(st.sampled_from(cases), label="case")
        value = data.draw(st.sampled_from(EXTREMES.get(case.type) or [None]), label="value")
        length = data.draw(st.sampled_from(lengths[case.kind]), label="length")
        _check_answer(api, bases, case, value, length)

    return answered


def test_every_numeric_field_at_its_extremes_is_answered_at_once(api: Api) -> None:
    bases = _base_requests(api.job_id)
    cases = _all_cases(api.job_id)
    assert {case.method for case in cases} == set(bases)  # every method has a case
    for method, request in bases.items():
        assert _call(api, method, request)[0] in ALLOWED, method  # each base request is valid
    for case in cases:  # every field at every one of its extremes, once
        for value in EXTREMES.get(case.type) or [None]:
            _check_answer(api, bases, case, value, 1)
    ordinary = [0, 1, 2, 65]
    answered = _answered(api, dict.fromkeys(["scalar", "repeated", "messages", "map"], ordinary))
    answered()  # the first pass also loads what first uses load (the model, ONNX export)
    before = api.memory()
    answered()  # the same examples again: what they cost, not what a first use loads
    after = api.memory()
    print(f"\nAPI memory over the second pass: {before} -> {after}")
    assert after["VmHWM"] - before["VmHWM"] <= FLAT_BYTES, (before, after)


def test_huge_repeated_fields_within_the_message_limit_are_answered_at_once(api: Api) -> None:
    huge = {"repeated": [HUGE], "messages": [HUGE_MESSAGES], "map": [HUGE_MESSAGES]}
    answered = _answered(api, huge)
    answered()  # the first pass also grows the allocator's pools to messages of this size
    before = api.memory()
    answered()
    after = api.memory()
    print(f"\nAPI memory over a second pass of huge lists: {before} -> {after}")
    assert after["VmRSS"] - before["VmRSS"] <= HUGE_KEPT_BYTES, (before, after)
    assert after["VmHWM"] - before["VmHWM"] <= HUGE_PEAK_BYTES, (before, after)


def test_an_upload_header_names_its_shape(api: Api) -> None:
    for shape in ([2**31, 2**31], [1] * HUGE):
        header = pb.DatasetHeader(shape=shape)
        code, details = _call(api, "UploadDataset", pb.UploadDatasetRequest(header=header))
        assert code in ALLOWED - {grpc.StatusCode.OK}
        assert details.startswith("header.shape"), details
