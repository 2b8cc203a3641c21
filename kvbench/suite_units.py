"""A suite's units: one case at one sweep point and repetition, and running one.

Each unit has a stable id (a hash of kind, name, explicit parameters and repetition) kept
in every record's `method["suite_case"]`; `execute` runs it to completion, turning a
failure or an unmet requirement into one record and an interrupt into CaseInterrupted with
the records finished so far. kvbench.suite writes them; kvbench.suite_jobs and
kvbench.fleet run units in other processes and machines.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from kvbench.schema import Record, not_measured
from kvbench.suite_spec import Case, Suite


@dataclass(frozen=True)
class Unit:
    """One thing to run: a case at one sweep point and repetition (on one fleet machine
    when a fleet fans the case out)."""

    case: Case
    params: dict[str, Any]
    rep: int
    label: str = field(compare=False)
    machine: str | None = None

    @property
    def key(self) -> str:
        """What resume matches (store.unit_key): the case id, '@machine' when fanned out."""
        return f"{self.case_id}@{self.machine}" if self.machine else self.case_id

    @property
    def case_id(self) -> str:
        where = [self.case.requires] if self.case.requires else []  # same params, other place
        key = json.dumps([self.case.kind, self.case.name, self.params, self.rep, *where],
                         sort_keys=True, default=str)
        return hashlib.sha1(key.encode()).hexdigest()[:12]

    def command(self) -> str:
        """The equivalent single command line (options mirror config fields one to one)."""
        from kvbench.options import to_argv

        return shlex.join(["kvbench", "probe" if self.case.kind == "probe" else "run",
                           self.case.name, *to_argv(self.params)])


def units(suite: Suite, only: str | None = None) -> list[Unit]:
    """Every unit of the suite in file order (`order = "round"`: by repetition first),
    optionally those whose label (or case id)
    matches the glob `only`; brackets in it are literal, as in the labels
    ('quest[*budget_tokens=64]*'), so `*` and `?` are its only wildcards."""
    if only is not None:
        only = re.sub(r"[][]", r"[\g<0>]", only)  # '[' -> '[[]', ']' -> '[]]'
    out = []
    for case in suite.cases:
        keys = list(case.sweep)
        for point in itertools.product(*(case.sweep[k] for k in keys)):
            params = {**case.params, **dict(zip(keys, point, strict=True))}
            for rep in range(case.repetitions):
                label = f"{case.name}[{','.join(f'{k}={v}' for k, v in params.items())}]#{rep}"
                if only is None or fnmatch.fnmatch(label, only) or (
                        case.id and fnmatch.fnmatch(case.id, only)):
                    out.append(Unit(case, params, rep, label))
    if suite.order == "round":  # repetition r of every case before any case's r + 1
        out.sort(key=lambda u: u.rep)
    return out


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class CaseInterrupted(BaseException):
    """An interrupt (Ctrl-C, SIGTERM) inside a unit: `cause`, with the records the unit had
    finished, each marked `method.partial`, for the writer to keep before it goes on."""

    def __init__(self, unit: Unit, records: list[Record], cause: BaseException) -> None:
        super().__init__(unit.label)
        self.unit, self.records, self.cause = unit, records, cause


def execute(unit: Unit, gpu: bool) -> list[Record]:
    """Run one unit to completion; a failure or an unmet requirement becomes one record,
    an interrupt CaseInterrupted."""
    case = unit.case
    if case.requires == "gpu" and not gpu:
        return [not_measured(case.kind, case.name, "case", "waived",
                             "case requires a CUDA GPU; none on this machine", unit.params)]
    records: list[Record] = []
    try:
        for rec in case.records(case.build(unit.params)):
            records.append(rec)
    except Exception as e:  # a failing case is recorded and the suite goes on
        return [not_measured(case.kind, case.name, "case", "error",
                             f"{type(e).__name__}: {e}".strip(), unit.params)]
    except BaseException as e:  # KeyboardInterrupt, SIGTERM (cli.Terminated): stop here
        for rec in records:  # a strategy's run labels its own (steps completed)
            rec.method.setdefault("partial", f"interrupted ({type(e).__name__}) before the "
                                  "case finished")
        raise CaseInterrupted(unit, records, e) from e
    return records or [not_measured(case.kind, case.name, "case", "error",
                                    "case produced no records", unit.params)]
