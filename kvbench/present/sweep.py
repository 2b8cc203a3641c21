"""A sweep seen from its parameters: the headline metrics pivoted against what varies.

Records of several runs (one result file, or a suite's) hold strategies whose parameters
differ. For each headline metric, `sweep_tables` makes the columns of the first knob
(`KNOBS`: budgets through the `budget` alias of `--budget-tokens` and `--gpu-tokens`, then
batch, lengths) that varies for two strategies or more (else the parameter varying most
often), and keeps every other parameter that varies in the row label, so a row never hides
the setting that tells it from the next one (kvbench.present.pivot).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.present.pivot import PER_RECORD, Pivot
from kvbench.present.table import Table

METRICS = ("perplexity", "passkey_accuracy", "top10_recall", "decode_tokens_per_s",
           "step_efficiency")
ALIASES = {"budget": ("budget_tokens", "gpu_tokens")}
_ALIAS_OF = {k: a for a, keys in ALIASES.items() for k in keys}
_IGNORED = (*PER_RECORD, "steps_completed")
# the knobs a sweep is about, in the order they make the columns
KNOBS = ("budget", "batch", "prompt_len", "context", "depth", "gen_len")


def varying(records: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Per strategy, the parameters (aliases applied) and `version` that take several
    values; a parameter some of its records lack varies (absent is a value)."""
    rows = [(r["name"], {**{_ALIAS_OF.get(k, k): v for k, v in (r.get("params") or {}).items()
                            if k not in _IGNORED}, "version": r.get("version")})
            for r in records]
    keys: dict[str, set[str]] = defaultdict(set)
    for name, p in rows:
        keys[name] |= set(p)
    values: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, p in rows:
        for k in keys[name]:
            values[name][k].add(repr(p.get(k)))
    return {name: {k for k, vals in by.items() if len(vals) > 1}
            for name, by in values.items()}


def _value(r: dict[str, Any], key: str) -> str:
    if key == "version":
        return repr(r.get("version"))
    p = r.get("params") or {}
    return repr(next((p[k] for k in ALIASES.get(key, (key,)) if k in p), None))


def _needed(records: list[dict[str, Any]], column: str, keys: list[str]) -> list[str]:
    """The row keys left once those set by the others and the column are dropped (a
    strategy's --pages that follows its budget would make a row per budget)."""
    keys = list(keys)
    for k in sorted(keys, reverse=True):
        rest = [x for x in keys if x != k]
        seen: dict[tuple, str] = {}
        if all(seen.setdefault((r["name"], _value(r, column), *(_value(r, x) for x in rest)),
                               _value(r, k)) == _value(r, k) for r in records):
            keys = rest
    return keys


def sweep_tables(records: list[dict[str, Any]]) -> tuple[list[Table], list[str]]:
    """(a table per headline metric that was swept, notes on those that could not be
    pivoted: two runs with the same parameters)."""
    runs = [r for r in records if r.get("kind") == "run" and r["status"] == "ok"]
    tables, notes = [], []
    for metric in METRICS:
        recs = [r for r in runs if r["metric"] == metric]
        by_name = varying(recs)
        counts = Counter(k for keys in by_name.values() for k in keys)
        if not counts:
            continue
        knobs = [k for k in KNOBS if counts.get(k, 0) >= min(2, len(by_name))]
        column = knobs[0] if knobs else max(sorted(counts), key=counts.__getitem__)
        others = _needed(recs, column, sorted(set(counts) - {column}))
        pivot = Pivot(title=f"{metric} by {column}", metric=metric,
                      rows=("name", *others), columns=column, fmt=".4g", change=False)
        try:
            tables.append(Table(pivot, recs, ALIASES))
        except KvbenchError as e:
            notes.append(f"{metric}: not pivoted ({e})")
    return tables, notes
