"""A declared table (kvbench.present.pivot.Pivot) applied to records: its cells, each
traced to a run, the reference each is compared with, its rows and columns in order, and
its text (markdown, or a header and rows for any renderer)."""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections import defaultdict
from typing import Any

from kvbench.console import markdown_table
from kvbench.errors import KvbenchError
from kvbench.present.pivot import (
    Extra,
    Pivot,
    column_of,
    formatted,
    matches,
    run_key,
    shown_key,
    value_of,
)
from kvbench.timing import Stats


def _label(r: dict[str, Any], keys: tuple[str, ...], aliases: dict,
           varying: set[tuple[Any, str]] | None) -> str:
    """The row label: the first key's value, then the other keys that vary among the rows
    of that first value (`varying`: (first value, key) pairs; None: every key)."""
    if varying is None:
        return " / ".join(shown_key(k, value_of(r, k, aliases)) for k in keys)
    head = value_of(r, keys[0], aliases)
    rest = [(k, v) for k in keys[1:] if (head, k) in varying
            and (v := value_of(r, k, aliases)) is not None]
    return shown_key(keys[0], head) + (" (" + ", ".join(f"{k} {shown_key(k, v)}" for k, v in rest)
                                    + ")" if rest else "")


def _times(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pooled_stats(recs: list[dict[str, Any]]) -> dict[str, float] | None:
    """The stats of pooled runs' samples together (their spread), None without samples."""
    samples = [v for x in recs for v in x.get("samples") or []]
    return dataclasses.asdict(Stats.of(samples)) if samples else None


def _natural(text: str) -> list[Any]:
    """Sort key reading numbers as numbers: '64 (...)' before '128', '0.5' after '0.25'."""
    return [(0, float(t)) if t[:1].isdigit() else (1, t)
            for t in re.split(r"(\d+(?:\.\d+)?)", text)]


class Table:
    """The pivot applied to records: cells, reference, what was left out."""

    def __init__(self, pivot: Pivot, records: list[dict[str, Any]],
                 aliases: dict[str, tuple[str, ...]]) -> None:
        self.p, self.aliases = pivot, aliases
        self.metrics = (pivot.metric,) if isinstance(pivot.metric, str) else pivot.metric
        chosen = [r for r in records if matches(r, pivot.where, aliases)]
        self.errors = [r for r in chosen if r["status"] == "error" and r["metric"] in
                       (*self.metrics, "case")]
        ok = [r for r in chosen if r["status"] == "ok"]
        self.by_run: dict[tuple, dict[str, list[dict[str, Any]]]] = defaultdict(
            lambda: defaultdict(list))
        for r in ok:
            self.by_run[run_key(r)][r["metric"]].append(r)
        ref = pivot.reference
        mains = [r for r in ok if r["metric"] in self.metrics]
        if pivot.statistic != "value":
            mains = [self._statistic(r) for r in mains]
        if pivot.reduce is not None:
            mains = self._reduced(mains)
        if pivot.median_over is not None:
            mains = self._pooled(mains)
        # the reference per column (a reference run without the column: one for all)
        self.refs: dict[Any, dict[str, Any]] = {}
        if pivot.reference_in not in ("column", "row"):
            raise KvbenchError(f"table '{pivot.title}': reference_in "
                               f"'{pivot.reference_in}': column or row")
        by_column = ref if pivot.reference_in == "column" else None
        for r in (r for r in mains if by_column and matches(r, by_column, aliases)):
            col = self._ref_key(r)
            if col in self.refs and run_key(self.refs[col]) != run_key(r):
                raise KvbenchError(f"table '{pivot.title}': the reference {ref} matches two "
                                   f"runs at {self._ref_fields()} {col}")
            self.refs[col] = r
        # shown above the table (one reference for every column), or in its own row
        self.ref = self.refs.pop(None, None) if pivot.reference_by is None else None
        first: dict[Any, dict[str, set]] = defaultdict(lambda: defaultdict(set))
        for r in mains:
            for k in pivot.rows[1:]:
                first[value_of(r, pivot.rows[0], aliases)][k].add(
                    repr(value_of(r, k, aliases)))
        varying = {(h, k) for h, by in first.items() for k, vals in by.items()
                   if len(vals) > 1}
        self.cells: dict[tuple[str, Any], dict[str, Any]] = {}
        for r in mains:
            if r is self.ref:
                continue
            key = (_label(r, pivot.rows, aliases, None if pivot.every_key else varying),
                   column_of(r, pivot.columns, aliases))
            if key in self.cells and self.cells[key] is not r:
                what = "runs" if run_key(self.cells[key]) != run_key(r) else "records of one run"
                raise KvbenchError(f"table '{pivot.title}': two {what} for one cell (row "
                                   f"'{key[0]}', {self.column_name} {key[1]})")
            self.cells[key] = r
        self.row_refs: dict[str, dict[str, Any]] = {}  # reference_in = "row"
        for (row, _), r in self.cells.items():
            if pivot.reference_in == "row" and ref and matches(r, ref, aliases):
                if row in self.row_refs:
                    raise KvbenchError(f"table '{pivot.title}': the reference {ref} matches "
                                       f"two runs in row '{row}'")
                self.row_refs[row] = r
        # every record of the runs shown, once (a run may fill several cells)
        self.records = list({id(x): x for r in mains for x in self._run_records(r)}.values())

    def _ref_fields(self) -> str:
        by = self.p.reference_by
        return self.column_name if by is None else " / ".join(by) or "the"

    def _ref_key(self, r: dict[str, Any]) -> Any:
        """Which cells a reference run serves: its column, or its `reference_by` values."""
        if self.p.reference_by is None:
            return column_of(r, self.p.columns, self.aliases)
        return tuple(repr(value_of(r, k, self.aliases)) for k in self.p.reference_by)

    def reference(self, r: dict[str, Any], row: str = "") -> dict[str, Any] | None:
        """The record `r`'s change is taken against: its row's reference (reference_in
        "row"), else its column's or group's (None: none, or the record is its own)."""
        got = self.row_refs.get(row) if self.p.reference_in == "row" else \
            self.refs.get(self._ref_key(r), self.ref)
        return None if got is None or run_key(got) == run_key(r) else got

    def _statistic(self, r: dict[str, Any], statistic: str | None = None) -> dict[str, Any]:
        statistic = statistic or self.p.statistic
        got = (r.get("stats") or {}).get(statistic)
        if got is None:
            raise KvbenchError(f"table '{self.p.title}': statistic '{statistic}' is "
                               f"not in the stats of {r['name']} {r['metric']}")
        return {**r, "value": got}

    def _reduced(self, mains: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One record per run: the `reduce` of its records' means over steps."""
        if self.p.reduce not in ("sum", "mean"):
            raise KvbenchError(f"table '{self.p.title}': reduce '{self.p.reduce}': sum or mean")
        runs: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
        for r in mains:
            runs[(run_key(r), r["metric"])].append(r)
        out = []
        for recs in runs.values():
            means = [x["stats"]["mean"] for x in recs]
            total = sum(means)
            out.append({**recs[0], "value": total if self.p.reduce == "sum"
                        else total / len(means)})
        return out

    def _pooled(self, mains: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One record per cell: the median of its runs that differ in `median_over`."""
        groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
        for r in mains:
            groups[run_key(r, self.p.median_over, unit=False), r["metric"]].append(r)
        return [{**recs[0], "value": statistics.median(x["value"] for x in recs),
                 "stats": _pooled_stats(recs), "_runs": [run_key(x) for x in recs],
                 "_by": {self._pair(x): x["value"] for x in recs}}
                for recs in groups.values()]

    def _pair(self, r: dict[str, Any]) -> Any:
        """What pairs a run with its reference's (`paired`): its median_over parameter, or
        for "repetition" the suite's repetition index (method.suite_repetition; None for a
        record run outside a suite, or before suites recorded it: no pair)."""
        if self.p.median_over == "repetition":
            return (r.get("method") or {}).get("suite_repetition")
        return repr(value_of(r, self.p.median_over, self.aliases))

    def _paired(self, r: dict[str, Any], ref: dict[str, Any]) -> str:
        """"; paired -x% (lo to hi, n pairs)": the median and range of the changes of r's
        runs against the reference's run of the same `_pair` ("" without a pair)."""
        mine, theirs = r.get("_by") or {}, ref.get("_by") or {}
        changes = sorted(v / theirs[k] - 1 for k, v in mine.items()
                         if k is not None and theirs.get(k))
        if not changes:
            return ""
        return (f"; paired {statistics.median(changes):+.1%} ({changes[0]:+.1%} to "
                f"{changes[-1]:+.1%}, {len(changes)} pairs)")

    def _run_records(self, r: dict[str, Any]) -> list[dict[str, Any]]:
        return [x for key in r.get("_runs", [run_key(r)])
                for recs in self.by_run[key].values() for x in recs]

    def extra(self, r: dict[str, Any], e: Extra) -> float | None:
        if "_runs" in r:  # a pooled cell: the median of its runs' extras
            got = [x for key in r["_runs"]
                   if (x := self.extra(self.by_run[key][r["metric"]][0], e)) is not None]
            return statistics.median(got) if got else None
        recs = [x for x in self.by_run[run_key(r)].get(e.metric, [])
                if matches(x, e.where, self.aliases)]
        if not recs:
            return None
        if e.sum_over is None and len(recs) > 1:
            raise KvbenchError(f"table '{self.p.title}': {len(recs)} records of "
                               f"'{e.metric}' in one run; set sum_over")
        if e.skip:
            return sum(sum(x["samples"][e.skip:]) / max(len(x["samples"]) - e.skip, 1)
                       for x in recs)
        if e.statistic == "value":
            return sum(x["value"] for x in recs)
        return sum(self._statistic(x, e.statistic)["value"] for x in recs)

    def _value(self, value: float) -> str:
        return formatted(value * self.p.scale, self.p.fmt)

    def cell(self, r: dict[str, Any] | None, col: Any, row: str = "") -> str:
        if r is None:
            return "-"
        v = r["value"]
        text = self._value(v)
        st = r.get("stats") or {}
        lo, hi = (st.get(k) for k in self.p.spread_stats)
        if self.p.spread and lo is not None and lo != hi:
            text += f" ({self._value(lo)}-{self._value(hi)})"
        ref = self.reference(r, row)
        if self.p.change and ref is not None and ref["value"]:
            paired = self._paired(r, ref) if self.p.paired else ""
            text += f" ({v / ref['value'] - 1:+.1%}{paired})"
        for e in self.p.extras:
            x = self.extra(r, e)
            if x is not None:
                text += f", {e.label}{formatted(x, e.fmt)}{e.unit}"
        return text

    def row_labels(self) -> list[str]:
        """Rows whose first key is in `order` first, in that order, then the rest."""
        heads = {label: str(value_of(r, self.p.rows[0], self.aliases))
                 for (label, _), r in self.cells.items()}
        order = {h: i for i, h in enumerate(self.p.order)}
        return sorted(heads, key=lambda label: (order.get(heads[label], len(order)),
                                                _natural(label)))

    @property
    def column_name(self) -> str:
        c = self.p.columns
        return c if isinstance(c, str) else " / ".join(c)

    def columns(self) -> list[Any]:
        """Sorted (numbers in text as numbers: "1 / 2048" before "1 / 16384"), or in the
        order of the metric list for `columns = "metric"`."""
        found = {k[1] for k in self.cells}
        if self.p.columns == "metric":
            return [m for m in self.metrics if m in found]
        return sorted(found, key=lambda c: (c is None, str(type(c)),
                                            _natural(c) if isinstance(c, str) else c))

    def grid(self) -> tuple[list[str], list[list[str]]]:
        """The table as a header and rows of text (any renderer: markdown, HTML, rich)."""
        p, cols = self.p, self.columns()
        heads = [" / ".join(p.rows)] + [f"{self.column_name} {c}" for c in cols] + [
            f"{a} / {b}" for a, b in p.ratios]
        rows, labels = [], self.row_labels()
        for row in labels:
            cells = [row] + [self.cell(self.cells.get((row, c)), c, row) for c in cols]
            cells += [_times(self._ratio(row, a, b)) for a, b in p.ratios]
            rows.append(cells)
        if p.summary:
            rows.append(self._summary(labels, cols))
        return heads, rows

    def _ratio(self, row: str, a: Any, b: Any) -> float | None:
        ra, rb = self.cells.get((row, a)), self.cells.get((row, b))
        return ra["value"] / rb["value"] if ra and rb and rb["value"] else None

    def _summary(self, labels: list[str], cols: list[Any]) -> list[str]:
        """The mean over rows of each cell's value / its reference, and of each ratio."""
        out = [f"mean over rows (vs {self._ref_fields()} reference)"]
        for c in cols:
            got = [r["value"] / ref["value"] for row in labels
                   if (r := self.cells.get((row, c))) and (ref := self.reference(r, row))
                   and ref["value"]]
            out.append(_times(sum(got) / len(got) if got else None))
        for a, b in self.p.ratios:
            got = [v for row in labels if (v := self._ratio(row, a, b)) is not None]
            out.append(_times(sum(got) / len(got) if got else None))
        return out

    def markdown(self, heading: str = "##") -> list[str]:
        p, cols = self.p, self.columns()
        out = [f"{heading} {p.title}", ""]
        if p.text:
            out += [p.text, ""]
        if self.ref is not None:
            out += [f"Reference ({', '.join(f'{k} {v}' for k, v in p.reference.items())}): "
                    f"{self._value(self.ref['value'])}", ""]
        out += markdown_table(*self.grid())
        if p.rank:
            out += ["", f"Ranking at each {self.column_name} ({p.rank} is better):", ""]
            for c in cols:
                got = sorted(((r["value"], row) for (row, col), r in self.cells.items()
                              if col == c), reverse=p.rank == "higher")
                sep = " < " if p.rank == "lower" else " > "
                out.append(f"- {self.column_name} {c}: " + sep.join(
                    f"{row} {self._value(v)}" for v, row in got))
        if p.reference_in == "row":
            out += ["", "Change against each row's reference "
                    f"({', '.join(f'{k} {v}' for k, v in (p.reference or {}).items())}), "
                    "absolute:", "", *self.changes()]
        for paper in p.paper:
            out += ["", f"The paper: {paper.citation}", "",
                    "| paper | " + " | ".join(f"{paper.column or self.column_name} {c}"
                                              for c in paper.columns)
                    + " |", "|---|" + "---|" * len(paper.columns)]
            out += [f"| {label} | " + " | ".join(map(str, vals)) + " |"
                    for label, vals in paper.rows.items()]
        return [*out, "", self.provenance()]

    def changes(self) -> list[str]:
        """Per column, the median and worst |change| of its cells against their references."""
        out = []
        for c in self.columns():
            got = [abs(r["value"] / ref["value"] - 1) for (row, col), r in self.cells.items()
                   if col == c and (ref := self.row_refs.get(row)) is not None
                   and ref is not r and ref["value"]]
            if got:
                out.append(f"- {self.p.columns} {c}: median {statistics.median(got):.1%}, "
                           f"worst {max(got):.1%} (n={len(got)})")
        return out

    def provenance(self) -> str:
        runs = {run_key(r) for r in self.records}
        commits = sorted({r.get("git_commit", "")[:7] for r in self.records} - {""})
        days = sorted({r.get("time", "")[:10] for r in self.records} - {""})
        text = (f"Records: {len(runs)} runs, {len(self.records)} records, commits "
                f"{', '.join(commits) or 'none recorded'}"
                + (f", {days[0]} to {days[-1]}" if days else "") + ".")
        if self.errors:
            text += " Left out, status error: " + "; ".join(
                f"{r['name']} {r['metric']} ({r.get('reason', '').splitlines()[0][:100]})"
                for r in self.errors)
        return text
