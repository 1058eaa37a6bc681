"""Shared output of every `kvferry bench`: a rich table, and with --json the same rows as a JSON list."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "-" if value is None else str(value)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def report(title: str, rows: Sequence[dict[str, Any]], json_path: str | None = None) -> None:
    """`rows` as a table (every column any row has) and, with `json_path`, as a JSON list."""
    columns: list[str] = []
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if rows and isinstance(rows[0].get(column), (int, float)) else "left")
    for row in rows:
        table.add_row(*(_fmt(row.get(c)) for c in columns))
    # Wide enough for every column when piped (rich would assume 80).
    Console(width=None if sys.stdout.isatty() else 240).print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([{c: row.get(c) for c in columns} for row in rows], f, indent=2)
