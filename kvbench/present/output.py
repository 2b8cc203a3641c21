"""`kvbench report`'s output: a terminal table, markdown or one self-contained HTML page.

kvbench.report builds the report (tables, figures, machines) and renders the table and
markdown forms; kvbench.html_report renders the HTML page from the same build. This module
picks one by format, so neither imports the other back.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.report import build, markdown, table

FORMATS = ("table", "markdown", "html")


def report(files: list[Path], fmt: str = "table", out: Path | None = None) -> Path | None:
    """Render `files` as a terminal table, markdown (stdout, or DIR/report.md + figures) or
    one self-contained DIR/report.html; returns the file written, if any."""
    from kvbench.console import wrote
    from kvbench.html_report import render
    from kvbench.paths import check_out

    if fmt not in FORMATS:
        raise KvbenchError(f"unknown format '{fmt}' ({', '.join(FORMATS)})")
    if fmt == "table":
        with tempfile.TemporaryDirectory() as tmp:
            table(build(files, Path(tmp)))
        return None
    if fmt == "markdown" and out is None:
        with tempfile.TemporaryDirectory() as tmp:
            print(markdown(build(files, Path(tmp)), None), end="")
        return None
    out = out or Path("results") / "report"
    check_out(out, folder=True)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "markdown":
        rep = build(files, out / "figures")
        path = out / "report.md"
        path.write_text(markdown(rep, Path("figures")), encoding="utf-8")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = out / "report.html"
            path.write_text(render(build(files, Path(tmp))), encoding="utf-8")
    wrote(path)
    return path
