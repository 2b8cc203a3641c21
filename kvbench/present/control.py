"""Negative controls: set-ups where no strategy can win, held against their reference.

A speed experiment declares, beside its tables, runs that must show no speed-up: a sparse
strategy with a budget covering the context (it reads all of full attention's KV and its
own metadata besides), or a context so short that weights dominate every step's bytes
(issue 26). Each control run is compared with the reference run that agrees with it on
`match` (e.g. full attention at the same prompt and batch); its gain (reference over control
for a lower-is-better metric such as tbt) must stay within the noise of the two runs: the
sum of their relative p10-p90 spreads, and at least `tolerance`. A control past that fails
`kvbench experiment render` (exit 1, the table still written with the verdict), so a
speed-up the experiment reports cannot come from a measurement artefact such as a machine
that got faster between runs. A case's repetitions pool into one run (their samples
together). With `bound = true` a control may also gain what its counted bytes allow (the
reference's `step_bytes` total over its own, minus 1; kvbench.runtime.bound): at a short
context a sparse strategy still reads a little less KV, and only a gain past that share
plus the noise is an artefact.

    [[control]]
    title = "A budget covering the context reads full's bytes: no speed-up"
    where = { name = "quest", budget_share = "2x" }
    reference = { name = "full" }
    match = ["prompt_len", "batch"]
    metric = "tbt"            # default
    tolerance = 0.10          # default: the smallest gain that counts, whatever the spread
    bound = false             # default: no gain allowed beyond the noise
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.present.pivot import matches, run_key, shown_key, value_of
from kvbench.timing import Stats

# what tells a control's runs apart in its rows besides the fields it matches on
LABEL = ("variant", "topk_per", "budget_share")


@dataclass(frozen=True)
class Control:
    """One `[[control]]` (module docstring)."""

    title: str
    where: dict[str, Any]
    reference: dict[str, Any]
    match: tuple[str, ...] = ()
    metric: str = "tbt"
    tolerance: float = 0.10
    text: str = ""
    bound: bool = False


@dataclass(frozen=True)
class Verdict:
    """A control run against its reference: medians, the gain and the noise it may have."""

    run: str
    control: Stats
    reference: Stats
    gain: float  # > 0: the control is better than its reference by this share
    noise: float  # the gain the two runs' spread allows
    bytes_gain: float = 0.0  # the gain its counted bytes allow (Control.bound)

    @property
    def allowed(self) -> float:
        return self.bytes_gain + self.noise

    @property
    def ok(self) -> bool:
        return self.gain <= self.allowed


@dataclass
class _Run:
    first: dict[str, Any]
    samples: list[float] = field(default_factory=list)


def _runs(records: list[dict[str, Any]], want: dict[str, Any], metric: str,
          aliases: dict) -> dict[tuple, _Run]:
    """The matching runs of `metric`, a case's repetitions pooled (samples together)."""
    out: dict[tuple, _Run] = {}
    for r in records:
        if r["metric"] == metric and r["status"] == "ok" and matches(r, want, aliases):
            run = out.setdefault(run_key(r, unit=False), _Run(r))
            run.samples += r.get("samples") or [r["value"]]
    return out


def verdicts(c: Control, records: list[dict[str, Any]], aliases: dict) -> list[Verdict]:
    """One verdict per control run; KvbenchError for a control run with no reference run,
    or with several, agreeing with it on `match`."""
    controls = _runs(records, c.where, c.metric, aliases)
    if not controls:
        raise KvbenchError(f"control '{c.title}': no {c.metric} records match {c.where}")
    refs: dict[tuple, list[_Run]] = defaultdict(list)
    for run in _runs(records, c.reference, c.metric, aliases).values():
        refs[tuple(repr(value_of(run.first, k, aliases)) for k in c.match)].append(run)
    out = []
    for key, run in controls.items():
        at = tuple(repr(value_of(run.first, k, aliases)) for k in c.match)
        found = [x for x in refs.get(at, []) if run_key(x.first, unit=False) != key]
        label = ", ".join(f"{k} {shown_key(k, v)}" for k in ("name", *LABEL, *c.match)
                          if (v := value_of(run.first, k, aliases)) is not None)
        if len(found) != 1:
            raise KvbenchError(f"control '{c.title}': {len(found)} reference runs "
                               f"{c.reference} for {label} (need one)")
        mine, ref = Stats.of(run.samples), Stats.of(found[0].samples)
        lower = run.first.get("direction", "lower") == "lower"
        gain = ref.median / mine.median - 1 if lower else mine.median / ref.median - 1
        spread = sum((s.p90 - s.p10) / s.median for s in (mine, ref))
        allowed = max(0.0, _bytes(found[0], records) / _bytes(run, records) - 1) \
            if c.bound else 0.0
        out.append(Verdict(label, mine, ref, gain, max(c.tolerance, spread), allowed))
    return out


def _bytes(run: _Run, records: list[dict[str, Any]]) -> float:
    """The run's counted bytes per decode step (its `step_bytes` total)."""
    key = run_key(run.first, unit=False)
    got = [r["value"] for r in records if r["metric"] == "step_bytes" and r["status"] == "ok"
           and (r.get("params") or {}).get("where") == "total"
           and run_key(r, unit=False) == key]
    if not got:
        raise KvbenchError(f"control: no step_bytes total for {run.first['name']} "
                           f"{run.first.get('params')}: bound = true needs it")
    return got[0]


def markdown(c: Control, found: list[Verdict], fmt: str = ".4g") -> list[str]:
    """The control's section: one row per control run, its verdict last."""
    md = [f"### Control: {c.title}", ""]
    if c.text:
        md += [c.text, ""]
    md += [f"{c.metric}, median (p10-p90) of each run's steps, a case's repetitions pooled; "
           f"gain: how much better than its reference; allowed: the two runs' relative "
           f"p10-p90 spreads added, at least {c.tolerance:.0%}"
           + (", plus what its counted bytes allow (the reference's step_bytes over its "
              "own, minus 1)" if c.bound else "") + ".", "",
           f"| run | control | reference {c.reference} | gain | allowed | verdict |",
           "|---|---|---|---|---|---|"]
    for v in found:
        cells = [f"{format(s.median, fmt)} ({format(s.p10, fmt)}-{format(s.p90, fmt)})"
                 for s in (v.control, v.reference)]
        md.append(f"| {v.run} | {cells[0]} | {cells[1]} | {v.gain:+.1%} | {v.allowed:.1%} | "
                  f"{'pass' if v.ok else 'FAIL: faster than its reference beyond the noise'} |")
    return md
