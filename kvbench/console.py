"""Shared rich consoles and the one-line rendering of a record while a command runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console

from kvbench.schema import Record

# Logs and CI output are not terminals: give them a width that fits a result table.
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)


def params_text(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def value_text(value: float | None, unit: str, stats: dict | None = None) -> str:
    """'12.3 GB/s (p10-p90 12.1-12.5, n=20)' or '-' for no value."""
    if value is None:
        return "-"
    text = f"{value:.4g} {unit}".strip()
    if stats and stats.get("n", 0) > 1:
        text += f" (p10-p90 {stats['p10']:.4g}-{stats['p90']:.4g}, n={stats['n']})"
    return text


def show_record(rec: Record) -> None:
    """Print one line per record as it is written."""
    head = f"[bold]{rec.name}[/] {rec.metric} [dim]{params_text(rec.params)}[/]"
    if rec.status != "ok":
        colour = "yellow" if rec.status == "waived" else "red"
        console.print(f"{head}: [{colour}]{rec.status}[/] {rec.reason}")
        return
    label = "" if rec.provenance == "measured" else " [magenta](projected)[/]"
    console.print(f"{head}: {value_text(rec.value, rec.unit, rec.stats)}{label}")


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a Markdown table; a '|' inside a cell is escaped."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows)]


def wrote(path: Path) -> None:
    console.print(f"results: [cyan]{path}[/]", soft_wrap=True)  # a path to copy, unbroken
