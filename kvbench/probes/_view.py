"""Live terminal view of a copy sweep: a progress bar over a pair x size table (rich)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbench.console import console, show_record, wrote
from kvbench.probes import Probe, run_and_store
from kvbench.schema import Record
from kvbench.units import format_size


class SweepView:
    """Rows are (pair, memory kind), columns sizes; `metric` records fill the cells and
    advance the bar, every other record is printed above the live area as a line.
    The live area starts with the first record: a probe rejecting its input draws nothing.
    It is redrawn only when a record arrives (between measurements), never from a refresh
    thread of its own: with as many copy threads as CPUs, a redraw during a sample would
    take a CPU from a copy thread and slow the sample it lands in."""

    def __init__(self, title: str, metric: str, total: int) -> None:
        self.title, self.metric = title, metric
        self.cells: dict[tuple[str, str], dict[int, str]] = {}
        self.sizes: list[int] = []
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console)
        self.task = self.progress.add_task(title, total=total)
        self.live = Live(self._render(), console=console, auto_refresh=False)

    def _render(self) -> Group:
        t = Table(title=self.title, title_justify="left")
        t.add_column("pair")
        t.add_column("memory")
        for s in self.sizes:
            t.add_column(format_size(s), justify="right")
        for (pair, kind), row in self.cells.items():
            t.add_row(pair, kind, *(row.get(s, "") for s in self.sizes))
        return Group(t, self.progress)

    def show(self, rec: Record) -> None:
        if not self.live.is_started:
            self.live.start()
        if rec.metric != self.metric or "size" not in rec.params:
            show_record(rec)  # the live console prints it above the live area
            self.live.refresh()
            return
        size = int(rec.params["size"])  # type: ignore[arg-type]
        if size not in self.sizes:
            self.sizes = sorted([*self.sizes, size])
        key = (f"{rec.params['src']}->{rec.params['dst']}", str(rec.params.get("memory")))
        cv = (rec.stats or {}).get("cv", 0.0)
        text = f"{rec.value:.3g}" if rec.value is not None else rec.status
        self.cells.setdefault(key, {})[size] = text + (" [yellow]~[/]" if cv > 0.05 else "")
        self.progress.advance(self.task)
        self.live.update(self._render(), refresh=True)

    def __enter__(self) -> SweepView:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.live.is_started:
            return
        self.live.update(self._render(), refresh=True)
        self.live.__exit__(*exc)
        if not console.is_terminal:  # rich leaves the last frame unterminated in logs
            console.line()



def run_with_view(probe: Probe, config: Any, out: Path | None, title: str, metric: str,
                  total: int) -> Path:
    """Run and store a sweep probe under a SweepView, then write its figures next to the
    result file (in a folder named after it) and print where everything went."""
    records: list[Record] = []
    with SweepView(title, metric, total) as view:
        def show(rec: Record) -> None:
            records.append(rec)
            view.show(rec)

        path = run_and_store(probe, config, out, show)
    wrote(path)
    for fig in probe.plot([r.to_dict() for r in records], path.with_suffix("")):
        console.print(f"figure: [cyan]{fig}[/]")
    return path
