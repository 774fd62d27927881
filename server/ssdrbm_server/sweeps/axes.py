"""The fields a sweep may vary, its points (grid or random draws), and one point → request.

A point maps each axis field to a number (``optimizer.kind`` to its enum number). Every point
is applied to a copy of the base request, which the one resolver (ssdrbm_server/resolver.py)
then resolves like any StartTraining request.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.errors import InvalidArgumentError
from ssdrbm_server.vocabulary import OPTIMIZER_NAMES

PER_PARAMETER_LR = "optimizer.per_parameter_lr."
SEED_FIELD = "training.seed"

Point = dict[str, float]  # axis field -> value (enum numbers and integers as floats, seeds as ints)


@dataclass(frozen=True)
class FieldKind:
    """How an axis field takes its values: ``number`` (float), ``integer``, ``optimizer``."""

    kind: str
    apply: Callable[[pb.StartTrainingRequest, float], None]


def _field(kind: str, path: str) -> FieldKind:
    """The kind whose ``apply`` sets ``path`` (``<message>.<field>``): as is for a number, as
    an int otherwise."""
    message, name = path.split(".")
    cast = (lambda value: value) if kind == "number" else int

    def apply(spec: pb.StartTrainingRequest, value: float) -> None:
        setattr(getattr(spec, message), name, cast(value))

    return FieldKind(kind, apply)


FIELDS = {
    field: _field(kind, field)
    for field, kind in [
        ("optimizer.lr", "number"),
        ("optimizer.momentum", "number"),
        ("optimizer.kind", "optimizer"),
        (SEED_FIELD, "integer"),
        ("training.cd_k", "integer"),
        ("model.n_hidden", "integer"),
    ]
}
FIELD_NAMES = [*FIELDS, PER_PARAMETER_LR + "<name>"]
_WHAT_VALUES = {"number": "finite numbers", "integer": "integers"}


def field_kind(field: str) -> FieldKind | None:
    """The field's kind; per-parameter step sizes by their parameter name."""
    if field.startswith(PER_PARAMETER_LR) and len(field) > len(PER_PARAMETER_LR):
        name = field[len(PER_PARAMETER_LR) :]

        def apply(spec: pb.StartTrainingRequest, value: float) -> None:
            spec.optimizer.per_parameter_lr[name] = value

        return FieldKind("number", apply)
    return FIELDS.get(field)


@dataclass(frozen=True)
class Axis:
    """One checked axis: explicit values, or (RANDOM mode) a range."""

    field: str
    kind: FieldKind
    values: tuple[float, ...]
    where: str  # the request field that gave it: "axes[<i>]" or "seeds"
    low: float = 0.0
    high: float = 0.0
    log: bool = False

    def sets(self, resolver_field: str) -> bool:
        """True when the resolver's field path (``optimizer.per_parameter_lr[W]``, ...) is
        this axis's field."""
        if self.field.startswith(PER_PARAMETER_LR):
            return (
                resolver_field
                == f"optimizer.per_parameter_lr[{self.field[len(PER_PARAMETER_LR) :]}]"
            )
        return resolver_field == self.field


def format_value(field: str, value: float) -> str:
    """How a point's value is shown: optimizer names, integers without a point, %g."""
    kind = field_kind(field)
    if kind is not None and kind.kind == "optimizer":
        return OPTIMIZER_NAMES.get(int(value), str(int(value)))
    if kind is not None and kind.kind == "integer":
        return str(int(value))
    return f"{value:g}"


def describe(point: Point) -> str:
    """``lr=0.001 optimizer.kind=sgd``: the point for names and messages."""
    return " ".join(f"{field}={format_value(field, value)}" for field, value in point.items())


def check_axes(request: pb.StartSweepRequest) -> list[Axis]:
    """The request's axes (with ``seeds`` as a training.seed axis), checked field by field;
    their sizes were bounded before (request_bounds.check_sweep)."""
    axes: list[Axis] = []
    random_mode = request.mode == pb.SWEEP_MODE_RANDOM
    for index, message in enumerate(request.axes):
        axes.append(_check_axis(message, f"axes[{index}]", random_mode))
    if request.seeds:
        if any(axis.field == SEED_FIELD for axis in axes):
            raise InvalidArgumentError("seeds", f"give seeds or a {SEED_FIELD} axis, not both")
        first = request.base.training.seed
        # Exact integers: a float would merge seeds from 2^53 on.
        values = tuple(first + i for i in range(request.seeds))
        _check_holds(FIELDS[SEED_FIELD], SEED_FIELD, values[-1], "seeds")
        axes.append(Axis(SEED_FIELD, FIELDS[SEED_FIELD], values, "seeds"))
    if not axes:
        raise InvalidArgumentError(
            "axes", "give at least one axis (e.g. optimizer.lr with values) or seeds"
        )
    fields = [axis.field for axis in axes]
    for field in fields:
        if fields.count(field) > 1:
            raise InvalidArgumentError("axes", f"{field} is given twice; one axis per field")
    return axes


def _check_axis(message: pb.SweepAxis, where: str, random_mode: bool) -> Axis:
    kind = field_kind(message.field)
    if kind is None:
        raise InvalidArgumentError(
            f"{where}.field", f"cannot vary {message.field!r}; choose one of {FIELD_NAMES}"
        )
    has_range = message.HasField("range")
    if kind.kind == "optimizer":
        if message.values or has_range:
            raise InvalidArgumentError(
                f"{where}.kinds", "optimizer.kind takes kinds (SGD, SSD, ...), not values"
            )
        for kind_value in message.kinds:
            if kind_value not in OPTIMIZER_NAMES:
                raise InvalidArgumentError(
                    f"{where}.kinds", f"{kind_value} is not an optimizer kind; name one"
                )
        values = tuple(float(v) for v in message.kinds)
    else:
        if message.kinds:
            raise InvalidArgumentError(f"{where}.kinds", "only optimizer.kind takes kinds")
        values = tuple(message.values)
        for value in values:
            if not math.isfinite(value) or (kind.kind == "integer" and value != int(value)):
                raise InvalidArgumentError(
                    f"{where}.values",
                    f"{message.field} takes {_WHAT_VALUES[kind.kind]}, got {value!r}",
                )
            _check_holds(kind, message.field, value, f"{where}.values")
    if has_range:
        if values:
            raise InvalidArgumentError(where, "give values or a range, not both")
        if not random_mode:
            raise InvalidArgumentError(
                f"{where}.range", "ranges are drawn from in RANDOM mode; give values for a grid"
            )
        return _range_axis(message, kind, where)
    if not values:
        raise InvalidArgumentError(where, f"{message.field} needs at least one value")
    return Axis(message.field, kind, values, where)


def _check_holds(kind: FieldKind, field: str, value: float, where: str) -> None:
    """INVALID_ARGUMENT naming ``where`` when the request field cannot hold ``value`` (an
    integer field has its wire type's range); the resolver then judges the values it holds."""
    try:
        kind.apply(pb.StartTrainingRequest(), value)
    except (ValueError, OverflowError):
        raise InvalidArgumentError(
            where, f"{field} = {format_value(field, value)} is out of the field's range"
        ) from None


def _range_axis(message: pb.SweepAxis, kind: FieldKind, where: str) -> Axis:
    low, high = message.range.low, message.range.high
    log = message.range.scale == pb.AXIS_SCALE_LOG
    if not (math.isfinite(low) and math.isfinite(high)) or high < low:
        raise InvalidArgumentError(
            f"{where}.range", f"needs finite low <= high, got [{low}, {high}]"
        )
    if log and low <= 0:
        raise InvalidArgumentError(f"{where}.range.low", f"a LOG range needs low > 0, got {low}")
    if kind.kind == "integer":  # draws are rounded: the ends are the extremes
        _check_holds(kind, message.field, float(round(low)), f"{where}.range.low")
        _check_holds(kind, message.field, float(round(high)), f"{where}.range.high")
    return Axis(message.field, kind, (), where, low, high, log)


def expand(axes: list[Axis], request: pb.StartSweepRequest) -> list[Point]:
    """The sweep's points: the grid's combinations in axis order, or ``samples`` random draws
    reproducible from ``seed``. Their number is request_bounds.check_sweep's, checked before."""
    if request.mode != pb.SWEEP_MODE_RANDOM:
        if request.samples:
            raise InvalidArgumentError("samples", "applies to RANDOM mode only; leave it unset")
        grid = itertools.product(*(axis.values for axis in axes))
        return [
            {axis.field: value for axis, value in zip(axes, combo, strict=True)} for combo in grid
        ]
    if request.samples < 1:
        raise InvalidArgumentError("samples", "RANDOM mode needs samples >= 1")
    draws = random.Random(request.seed)
    return [{axis.field: _draw(axis, draws) for axis in axes} for _ in range(request.samples)]


def _draw(axis: Axis, draws: random.Random) -> float:
    if axis.values:
        return axis.values[draws.randrange(len(axis.values))]
    if axis.log:
        value = math.exp(draws.uniform(math.log(axis.low), math.log(axis.high)))
    else:
        value = draws.uniform(axis.low, axis.high)
    return float(round(value)) if axis.kind.kind == "integer" else value


def apply_point(base: pb.StartTrainingRequest, point: Point) -> pb.StartTrainingRequest:
    """A copy of ``base`` with the point's values set."""
    spec = pb.StartTrainingRequest()
    spec.CopyFrom(base)
    for field, value in point.items():
        kind = field_kind(field)
        assert kind is not None  # checked by check_axes
        kind.apply(spec, value)
    return spec
