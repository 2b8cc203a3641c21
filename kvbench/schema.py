"""The one result schema: flat, long-format records, one per measured quantity (JSON Lines).

A result file holds two kinds of line:
  {"schema_version": 1, "kind": "env", "env_id": ..., "env": {...}}   once per environment
  {"schema_version": 1, "kind": "probe" | "run", "name": ..., "metric": ..., ...}

`value` is the median of `samples` (in `unit`); `direction` says whether higher or lower
is better; `provenance` is "measured" or "projected" and is never left implicit; `status`
is "ok", "waived" (not applicable here, `reason` says why) or "error" (`reason` says what).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvbench.timing import Stats, Timing

SCHEMA_VERSION = 1
KNOWN_SCHEMA_VERSIONS = frozenset({1})

Direction = Literal["higher", "lower", "none"]
Status = Literal["ok", "waived", "error"]
Provenance = Literal["measured", "projected"]
ParamValue = str | int | float | bool | None


@dataclass
class Record:
    """One measured (or projected) quantity; the store fills the provenance-of-run fields."""

    kind: Literal["probe", "run"]
    name: str
    metric: str
    unit: str
    direction: Direction
    value: float | None
    params: dict[str, ParamValue] = field(default_factory=dict)
    samples: list[float] = field(default_factory=list)
    stats: dict[str, float] | None = None
    status: Status = "ok"
    reason: str = ""
    provenance: Provenance = "measured"
    method: dict[str, Any] = field(default_factory=dict)
    version: str = "1"
    # filled by the store when written
    schema_version: int = SCHEMA_VERSION
    env_id: str = ""
    kvbench_version: str = ""
    git_commit: str = ""
    git_dirty: bool = False
    command: str = ""
    time: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measured(
    kind: Literal["probe", "run"],
    name: str,
    metric: str,
    unit: str,
    direction: Direction,
    samples: Sequence[float],
    params: dict[str, ParamValue] | None = None,
    method: dict[str, Any] | None = None,
    version: str = "1",
) -> Record:
    """A measured record whose value is the median of samples (already in `unit`)."""
    st = Stats.of(samples)
    return Record(kind=kind, name=name, metric=metric, unit=unit, direction=direction,
                  value=st.median, params=dict(params or {}), samples=[float(s) for s in samples],
                  stats=st.to_dict(), method=dict(method or {}), version=version)


def from_timing(
    kind: Literal["probe", "run"],
    name: str,
    timing: Timing,
    params: dict[str, ParamValue] | None = None,
    metric: str = "time",
    version: str = "1",
) -> Record:
    """A measured time record (seconds, lower is better) straight from a Timing."""
    return measured(kind, name, metric, "s", "lower", timing.seconds, params, timing.method(),
                    version)


def not_measured(
    kind: Literal["probe", "run"],
    name: str,
    metric: str,
    status: Literal["waived", "error"],
    reason: str,
    params: dict[str, ParamValue] | None = None,
    version: str = "1",
) -> Record:
    """A record that says why a quantity was not measured here."""
    return Record(kind=kind, name=name, metric=metric, unit="", direction="none", value=None,
                  params=dict(params or {}), status=status, reason=reason, version=version)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


RecordKey = tuple[str, str, str, str, tuple[tuple[str, str], ...]]


def record_key(rec: dict[str, Any]) -> RecordKey:
    """Identity of a quantity across files: kind, name, metric, provenance and parameters."""
    params = tuple(sorted((k, repr(v)) for k, v in (rec.get("params") or {}).items()))
    return (rec["kind"], rec["name"], rec["metric"], rec.get("provenance", "measured"), params)
