"""Re-time a stage graph (kvbench.runtime.trace) on a hardware profile.

List scheduling in task order (dependencies always point to earlier tasks): a task starts
when every task it waits for has finished and its resource is free, and holds the
resource for its duration. Resources: the accelerator's compute stream (in order), one
copy engine per direction ("h2d", "d2h"), the host thread pool ("host"; the same resource
as "accel" when the profile says `accel.shares_host`, as on a CPU-only machine), a CXL
link and a PNM device (the host pool when `pnm.shares_host`: the PNM role run on the host
CPU, as `--hardware this` has it).

Durations (kvbench.hwmodel.profile fields):
    accel dense      max(flops / (peak * eff), bytes read + written / (dense_gbps(rows) *
                     eff)); dense_gbps (over rows) defaults to memory_gbps
    accel attention  max(flops / (peak * eff), bytes read / attention_gbps(bytes read))
    host attention   bytes read / host.attention_gbps(bytes read)
    copies           bytes / curve(bytes per copy), pinned or pageable curve
    pnm              max(flops / pnm.peak_tflops, bytes / pnm.memory_gbps)
    carried          measured seconds, as recorded (bookkeeping without a work model), or 0
                     with `carried=False` (`kvbench project --bookkeeping none`: a bound
                     for a machine where that work runs off the critical path)
    dispatch         a CPU run's per-step Python and small torch ops (Counters.step_end):
                     carried as measured onto a profile whose accelerator role is the host
                     CPU (`accel.shares_host`, as `--hardware this` on a CPU-only machine),
                     and then no launch costs (they are in it); 0 on a GPU profile, whose
                     host issues kernels asynchronously (launch_us per launch stands for it)
plus launches * launch_us on the accelerator and host. A step ends when its last non-
background task ends; its time is that minus the previous step's end (the first step:
from 0). Background work keeps its resource busy into later steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvbench.hwmodel.profile import Profile
from kvbench.runtime.trace import Task

DENSE = ("pre", "post", "head")


@dataclass
class StepTime:
    """One step re-timed: seconds, busy seconds per resource (and per "resource:op"),
    bytes per link, and `carried`: busy seconds taken as measured (not modelled)."""

    step: int
    seconds: float = 0.0
    carried: float = 0.0
    busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    moved: dict[str, float] = field(default_factory=lambda: defaultdict(float))


class Timer:
    """Task durations on one profile (the module docstring's formulas)."""

    def __init__(self, prof: Profile, dtype: str, memory: str, carried: bool = True,
                 dispatch: bool = False) -> None:
        self.p = prof
        self.memory = memory
        self.carried = carried  # False: bookkeeping without a work model takes no time
        # the run carries its measured dispatch and this profile's accelerator is the host
        self.dispatch = dispatch and bool(prof.get("accel", "shares_host"))
        self.eff = float(prof.get("accel", "efficiency", 1.0))
        self.flops = prof.tflops(dtype) * 1e12 * self.eff
        self.mem = float(prof.need("accel", "memory_gbps", "accelerator tasks' bytes")) \
            * 1e9 * self.eff
        self.launch = float(prof.need("accel", "launch_us", "task launches")) * 1e-6
        self.host_launch = float(prof.need("host", "launch_us", "host task launches")) * 1e-6
        if self.dispatch:  # launch overheads are part of the carried dispatch
            self.launch = self.host_launch = 0.0

    def dense(self, rows: float) -> float:
        """B/s of dense layers at `rows` rows: accel.dense_gbps (a curve over rows, from the
        roofline probe's linear points) when given, else memory_gbps."""
        if self.p.get("accel", "dense_gbps") is None:
            return self.mem
        return self.p.rate("accel", "dense_gbps", rows, "dense tasks") * 1e9 * self.eff

    def resource(self, res: str) -> str:
        """The resource a task occupies: the PNM device is the host CPU when the profile's
        pnm.shares_host (`--hardware this`), the host the accelerator when accel.shares_host."""
        if res == "pnm" and self.p.get("pnm", "shares_host"):
            res = "host"
        return "accel" if res == "host" and self.p.get("accel", "shares_host") else res

    def seconds(self, t: Task) -> float:
        w = t.work
        if t.op == "dispatch":
            return w.get("seconds", 0.0) if self.dispatch and self.carried else 0.0
        if w.get("seconds"):
            return w["seconds"] if self.carried else 0.0
        flops, rd = w.get("flops", 0.0), w.get("bytes_read", 0.0)
        wr, launches = w.get("bytes_written", 0.0), w.get("launches", 0.0)
        if t.resource == "accel":
            if t.op in DENSE:
                return max(flops / self.flops, (rd + wr) / self.dense(w.get("rows", 1.0))) \
                    + launches * self.launch
            gbps = self.p.rate("accel", "attention_gbps", rd, "accelerator attention tasks")
            return max(flops / self.flops, rd / (gbps * 1e9 * self.eff)) \
                + launches * self.launch
        if t.resource == "host":
            gbps = self.p.rate("host", "attention_gbps", rd, "host attention tasks")
            return rd / (gbps * 1e9) + launches * self.host_launch
        if t.resource in ("h2d", "d2h"):
            return self.p.curve(t.resource, self.memory).seconds(w.get("bytes_moved", 0.0),
                                                                 w.get("copies", 1.0))
        if t.resource == "cxl":
            return self.p.curve("cxl", "pageable").seconds(w.get("bytes_moved", 0.0),
                                                           w.get("copies", 1.0))
        if t.resource == "pnm":
            tf = float(self.p.need("pnm", "peak_tflops", "PNM tasks")) * 1e12
            bw = float(self.p.need("pnm", "memory_gbps", "PNM tasks")) * 1e9
            return max(flops / tf, rd / bw)
        return 0.0


def tasks_of(rows: list[list[Any]], columns: list[str], step: int) -> list[Task]:
    """Task objects from a trace.tasks record's rows."""
    col = {c: i for i, c in enumerate(columns)}
    work_cols = [c for c in columns if c not in ("id", "layer", "resource", "op", "after",
                                                 "background")]
    return [Task(int(r[col["id"]]), step, int(r[col["layer"]]), r[col["resource"]],
                 r[col["op"]], {c: float(r[col[c]]) for c in work_cols},
                 [int(a) for a in r[col["after"]]], bool(r[col["background"]])) for r in rows]


def schedule(tasks: list[Task], timer: Timer) -> list[StepTime]:
    """Re-time every step of a run; tasks of all steps, any order."""
    tasks = sorted(tasks, key=lambda t: t.id)
    free: dict[str, float] = defaultdict(float)
    finish: dict[int, float] = {}
    ends: dict[int, float] = {}
    out: dict[int, StepTime] = {}
    order: list[int] = []
    for t in tasks:
        if t.step not in out:
            out[t.step] = StepTime(t.step)
            order.append(t.step)
        res = timer.resource(t.resource)
        start = max([free[res], *(finish.get(a, 0.0) for a in t.after)])
        dur = timer.seconds(t)
        finish[t.id] = start + dur
        free[res] = start + dur
        st = out[t.step]
        st.busy[res] += dur
        st.ops[f"{t.resource}:{t.op}"] += dur
        if t.work.get("seconds"):
            st.carried += dur
        if t.resource in ("h2d", "d2h", "cxl"):
            st.moved[t.resource] += t.work.get("bytes_moved", 0.0)
        if not t.background:
            ends[t.step] = max(ends.get(t.step, 0.0), start + dur)
    prev = 0.0
    for s in order:
        end = ends.get(s, prev)
        out[s].seconds = max(end - prev, 0.0)
        prev = max(prev, end)
    return [out[s] for s in order]
