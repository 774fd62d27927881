"""Results of the benchmark, printed as a readable table or as JSON lines (one object per line).

Three kinds of record: `environment` (what it ran on), `case` (one measured configuration with its
figures and the ratios measured in the same run) and `target` (a goal from the performance plan,
the figure it is judged on, and whether it was met).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

Number = float | int | None


@dataclass
class Case:
    """One measured configuration: its settings, its figures and its same-run ratios."""

    suite: str  # core | sklearn | service
    name: str  # a short label, unique within the suite
    config: dict[str, object]
    metrics: dict[str, Number]
    ratios: dict[str, Number] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return {
            "kind": "case",
            "suite": self.suite,
            "name": self.name,
            "config": self.config,
            "metrics": _clean(self.metrics),
            "ratios": _clean(self.ratios),
            "notes": self.notes,
        }


@dataclass
class Target:
    """A goal: `measured` compared with `limit` by `sense` (`<=` or `>=`); None = not measured."""

    suite: str
    name: str
    measured: Number
    limit: float
    sense: str  # "<=" or ">="
    unit: str = ""
    why: str = ""  # what limits the figure when the goal is missed, or why it is not measured

    @property
    def met(self) -> bool | None:
        if self.measured is None or not math.isfinite(float(self.measured)):
            return None
        if self.sense == "<=":
            return float(self.measured) <= self.limit
        return float(self.measured) >= self.limit

    def as_json(self) -> dict[str, object]:
        return {
            "kind": "target",
            "suite": self.suite,
            "name": self.name,
            "measured": _clean_number(self.measured),
            "limit": self.limit,
            "sense": self.sense,
            "unit": self.unit,
            "met": self.met,
            "why": self.why,
        }


@dataclass
class Report:
    """Everything one run measured."""

    environment: dict[str, object]
    cases: list[Case] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    def extend(self, cases: Iterable[Case], targets: Iterable[Target]) -> None:
        self.cases.extend(cases)
        self.targets.extend(targets)

    def json_lines(self) -> list[str]:
        records: list[dict[str, object]] = [{"kind": "environment", **self.environment}]
        records += [case.as_json() for case in self.cases]
        records += [target.as_json() for target in self.targets]
        return [json.dumps(record, sort_keys=False) for record in records]


def read_json_lines(lines: Iterable[str]) -> Report:
    """Rebuild a Report from its JSON lines (as written by `write(..., as_json=True)`)."""
    report = Report(environment={})
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        kind = record.pop("kind")
        if kind == "environment":
            report.environment = record
        elif kind == "case":
            report.cases.append(Case(**record))
        elif kind == "target":
            record.pop("met")
            report.targets.append(Target(**record))
        else:
            raise ValueError(f"unknown record kind {kind!r} in benchmark results")
    return report


def _clean_number(value: Number) -> Number:
    # JSON has no NaN or Infinity; an unmeasurable figure is null.
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _clean(values: dict[str, Number]) -> dict[str, Number]:
    return {key: _clean_number(value) for key, value in values.items()}


def format_number(value: object) -> str:
    """Three significant figures for floats, plain text otherwise, '-' for missing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table with columns padded to align in a terminal."""
    cells = [[format_number(value) for value in row] for row in rows]
    widths = [len(header) for header in headers]
    for row in cells:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]

    def line(values: Sequence[str]) -> str:
        padded = (value.ljust(width) for value, width in zip(values, widths, strict=True))
        return "| " + " | ".join(padded) + " |"

    separator = "| " + " | ".join("-" * width for width in widths) + " |"
    return "\n".join([line(headers), separator, *(line(row) for row in cells)])


def _suite_table(cases: Sequence[Case]) -> str:
    uniform = all(
        case.config.keys() == cases[0].config.keys()
        and case.metrics.keys() == cases[0].metrics.keys()
        for case in cases
    )
    return _wide_table(cases) if uniform else _compact_table(cases)


def _compact_table(cases: Sequence[Case]) -> str:
    # Cases that measure different things: one column each for settings, figures and ratios.
    def pairs(values: dict[str, object]) -> str:
        return ", ".join(f"{key} {format_number(value)}" for key, value in values.items())

    rows = [
        [case.name, pairs(case.config), pairs(case.metrics), pairs(case.ratios)] for case in cases
    ]
    return render_table(["case", "configuration", "figures", "ratios"], rows)


def _wide_table(cases: Sequence[Case]) -> str:
    config_keys = _ordered_keys(case.config for case in cases)
    metric_keys = _ordered_keys(case.metrics for case in cases)
    ratio_keys = _ordered_keys(case.ratios for case in cases)
    headers = ["case", *config_keys, *metric_keys, *ratio_keys]
    rows = [
        [
            case.name,
            *(case.config.get(key) for key in config_keys),
            *(case.metrics.get(key) for key in metric_keys),
            *(case.ratios.get(key) for key in ratio_keys),
        ]
        for case in cases
    ]
    return render_table(headers, rows)


def _ordered_keys(dicts: Iterable[dict[str, object]]) -> list[str]:
    keys: dict[str, None] = {}
    for mapping in dicts:
        keys.update(dict.fromkeys(mapping))
    return list(keys)


def render_text(report: Report) -> str:
    """The whole report as Markdown: environment, one table per suite, then the targets."""
    parts = ["## Environment", ""]
    parts += [f"- {key}: {format_number(value)}" for key, value in report.environment.items()]
    suites = list(dict.fromkeys(case.suite for case in report.cases))
    for suite in suites:
        suite_cases = [case for case in report.cases if case.suite == suite]
        parts += ["", f"## {suite}", "", _suite_table(suite_cases)]
        notes = list(dict.fromkeys(note for case in suite_cases for note in case.notes))
        parts += [f"- {note}" for note in notes]
    if report.targets:
        rows = [
            [
                target.suite,
                target.name,
                f"{target.sense} {format_number(target.limit)}{target.unit}",
                target.measured,
                {True: "met", False: "MISSED", None: "not measured"}[target.met],
                target.why,
            ]
            for target in report.targets
        ]
        parts += ["", "## Targets", ""]
        parts += [render_table(["suite", "target", "goal", "measured", "result", "note"], rows)]
    return "\n".join(parts) + "\n"


def write(report: Report, stream: TextIO, *, as_json: bool) -> None:
    """Write the report as JSON lines or as the Markdown tables."""
    if as_json:
        for line in report.json_lines():
            stream.write(line + "\n")
    else:
        stream.write(render_text(report))
    stream.flush()
