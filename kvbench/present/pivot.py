"""Records pivoted to a table: rows x columns of one metric, every cell traced to records
(the declaration and its record helpers; kvbench.present.table applies it).

A `Pivot` (an experiment's `[[table]]`, kvbench.experiment) takes the run records whose
fields match `where`, keys each by its `rows` fields and its `columns` field, and writes
the `metric`'s value per cell, with its change against a `reference` run (e.g. full
attention) and `extras`: other metrics of the same run (tokens attended per step, top-10
recall). A run is a strategy and its parameters; records that differ only in a
per-record field (`where`, `layer`, `phase`) belong to one run, and an extra with
`sum_over` adds them (tokens attended on the accelerator plus the host).

Fields are record keys (`name`, `metric`), parameters (`"-"` in a filter: absent) or
computed from them (`budget_share`: the budget over the prompt, "1/8"); an alias
(`budget`: the first of `budget_tokens`, `gpu_tokens` present) lets strategies with
differently named knobs share a column. Two runs in one cell are refused (one line naming
the cell), so a table never shows one of several values silently. Under the table: the
commits and dates its records span and the error records it left out. The papers' values
sit beside ours as `PaperTable`s.

A reference per row (`reference_in = "row"`) compares the cells of one row with its
reference cell, e.g. a run's projections (projected / measured - 1) beside the measured
run, and states each column's median and worst |change| under the table. `median_over`
pools the runs of one cell that differ only in that parameter (rounds of a grid repeated
in time) or in the suite unit that ran them (`median_over = "repetition"`: a case's
repetitions, e.g. interleaved by a suite's `order = "round"`) into their median. `paired`
then also gives each cell's change the way a paired design takes it: per value of
median_over (a round) the run's change against the reference run of that round, their
median and range; a round that ran slow or fast as a whole (a shared VM drifting between
rounds) moves both runs of its pair, where the change of the two medians mixes rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PER_RECORD = ("where", "layer", "phase")  # parameters that split one run into records
TOP_LEVEL = ("name", "metric", "status", "provenance", "git_commit", "version")


@dataclass(frozen=True)
class Extra:
    """Another metric of the cell's run shown after its value: label + value + unit."""

    metric: str
    fmt: str = ".3g"
    label: str = ""
    unit: str = ""
    sum_over: str | None = None  # add the run's records that differ in this parameter
    where: dict[str, Any] = field(default_factory=dict)  # only the run's records matching
    # (e.g. `{ where = "h2d.recall" }`: one link's bytes of a metric recorded per link)
    statistic: str = "value"  # or one of the record's stats, as Pivot.statistic
    skip: int = 0  # > 0: the mean of each record's samples after the first `skip` (steps)


@dataclass(frozen=True)
class PaperTable:
    """A paper's values beside ours: `rows` maps a label to one value per column."""

    citation: str
    columns: tuple[Any, ...]
    rows: dict[str, tuple[Any, ...]]
    column: str | None = None  # what its columns are (default: the table's columns key)


@dataclass(frozen=True)
class Pivot:
    """One table of an experiment (module docstring)."""

    title: str
    metric: str | tuple[str, ...]  # several: e.g. `columns = "metric"`
    rows: tuple[str, ...]
    columns: str | tuple[str, ...]  # several: each column is their values ("png-kv / 8")
    where: dict[str, Any] = field(default_factory=dict)
    fmt: str = ".3f"  # a format spec, or "seconds" / "bytes" (kvbench.units, "3.14 s")
    text: str = ""
    reference: dict[str, Any] | None = None
    # the reference of a cell is the reference run that agrees with it on these fields
    # (e.g. the baseline of the same model and GPU count); None: one per column
    reference_by: tuple[str, ...] | None = None
    change: bool = True  # each cell's change against the reference
    extras: tuple[Extra, ...] = ()
    rank: str | None = None  # "lower" or "higher": a ranking line per column
    # per-layer metrics (trace.*): a run's records reduced to one value, "sum" or "mean"
    # of each record's mean over steps; None: one record per run
    reduce: str | None = None
    # the value a cell shows: the record's `value`, or one of its `stats` ("mean": the mean
    # over steps of a per-layer trace record, whose value is the median)
    statistic: str = "value"
    spread: bool = False  # each value with its p10-p90 over samples...
    spread_stats: tuple[str, str] = ("p10", "p90")  # ...or two other of its stats (min, max)
    every_key: bool = False  # row labels give every row key's value ("8 / 8 / 64"), not only
    # the first and the keys that vary under it
    order: tuple[str, ...] = ()  # row labels first, in this order
    ratios: tuple[tuple[Any, Any], ...] = ()  # extra columns: column a's value / column b's
    summary: bool = False  # a last row: the mean over rows of each column's value over its
    # reference (reference_by) and of each ratio column
    paper: tuple[PaperTable, ...] = ()
    reference_in: str = "column"  # or "row": each row's reference cell (module docstring)
    median_over: str | None = None  # a cell's runs differing in this parameter: median
    # with median_over: also each cell's change paired, the median (and range) of its runs'
    # changes against the reference run of the same median_over value (module docstring)
    paired: bool = False
    scale: float = 1.0  # values shown times this (1000: seconds as ms; say so in the title)


def formatted(value: float, fmt: str) -> str:
    """`value` in a format spec, or as a time ("seconds") or a size ("bytes")."""
    from kvbench.units import format_bytes, format_seconds

    units = {"seconds": format_seconds, "bytes": format_bytes}
    return units[fmt](value) if fmt in units else format(value, fmt)


def budget_share(p: dict[str, Any]) -> str | None:
    """A run's budget (budget_tokens, else gpu_tokens) against its prompt: "1/8", or "2x"
    for a budget past the context; None without both."""
    budget = next((p[k] for k in ("budget_tokens", "gpu_tokens") if p.get(k)), None)
    if budget is None or not p.get("prompt_len"):
        return None
    ratio = budget / p["prompt_len"]
    return f"1/{1 / ratio:.3g}" if ratio < 1 else f"{ratio:.3g}x"


# fields a run's parameters give without holding them
COMPUTED = {"budget_share": budget_share}


def value_of(r: dict[str, Any], key: str, aliases: dict[str, tuple[str, ...]]) -> Any:
    """A record's top-level field (TOP_LEVEL), a computed field (COMPUTED), else a
    parameter (through `aliases`)."""
    if key in TOP_LEVEL:
        return r.get(key)
    p = r.get("params") or {}
    if key in COMPUTED:
        return COMPUTED[key](p)
    for k in aliases.get(key, (key,)):
        if k in p:
            return p[k]
    return None


def column_of(r: dict[str, Any], columns: str | tuple[str, ...], aliases: dict) -> Any:
    """A record's column: the field's value, or several fields' values joined ("a / b")."""
    if isinstance(columns, str):
        return value_of(r, columns, aliases)
    return " / ".join(shown_key(k, value_of(r, k, aliases)) for k in columns)


def matches(r: dict[str, Any], where: dict[str, Any], aliases: dict) -> bool:
    for k, want in where.items():
        got = value_of(r, k, aliases)
        got = "-" if got is None else got
        if got not in (want if isinstance(want, list) else [want]):
            return False
    return True


def run_key(r: dict[str, Any], but: str | None = None, unit: bool = True) -> tuple:
    """The run a record belongs to: its strategy, parameters but the per-record ones (and
    `but`: the runs of one cell under Pivot.median_over) and, with `unit`, the suite unit
    that ran it (a case's repetitions are runs of their own)."""
    p = r.get("params") or {}
    return r["name"], tuple(sorted((k, repr(v)) for k, v in p.items()
                                   if k not in PER_RECORD and k != but)), \
        (r.get("method") or {}).get("suite_case", "") if unit else ""


def shown_key(key: str, value: Any) -> str:
    """A row key's value in a label: commits short, floats to 4 digits, "" as "-"."""
    if key == "git_commit":
        return str(value)[:7]
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value in ("", None) else str(value)
