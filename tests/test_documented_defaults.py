"""docs/TRAINING.md's table of default step sizes is the table the server uses
(ssdcore/step_sizes.py).

The guide shows it for readers; this test keeps that copy honest. On a mismatch it prints the
block to paste between the guide's ``step-sizes`` markers.
"""

from __future__ import annotations

import re
from pathlib import Path

from ssdcore.step_sizes import step_size_table

TRAINING_DOC = Path(__file__).resolve().parents[1] / "docs" / "TRAINING.md"
BLOCK = re.compile(r"<!-- step-sizes:begin -->\n(.*?)<!-- step-sizes:end -->", re.DOTALL)


def rendered_table() -> str:
    """The step-size table as Markdown, one row per (model, variance) and a column per optimizer."""
    entries = step_size_table()
    optimizers = list(dict.fromkeys(entry.optimizer for entry in entries))
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for entry in entries:  # "short run → long run" where the value depends on the run's length
        value = f"{entry.lr:g}" if entry.short_lr is None else f"{entry.short_lr:g} → {entry.lr:g}"
        rows.setdefault((entry.model_kind, entry.variance or "-"), {})[entry.optimizer] = value
    lines = [
        "| model | variance | " + " | ".join(f"`{name}`" for name in optimizers) + " |",
        "| --- | --- |" + " ---: |" * len(optimizers),
    ]
    for (model, variance), values in rows.items():
        cells = " | ".join(values[name] for name in optimizers)
        lines.append(f"| {model} | {variance} | {cells} |")
    return "\n".join(lines) + "\n"


def test_the_documented_step_size_table_is_the_servers() -> None:
    match = BLOCK.search(TRAINING_DOC.read_text())
    assert match, "docs/TRAINING.md lost its <!-- step-sizes:begin/end --> markers"
    expected = rendered_table()
    assert match.group(1) == expected, f"update docs/TRAINING.md's step-size table to:\n{expected}"
