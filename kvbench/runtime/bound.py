"""The bytes bound of a decode step (issue 26 part 1): what the step must read over the
measured bandwidth of the memory it reads from, and the run's step time held against it.

Bytes per decode step come from the run's stage graph (kvbench.runtime.trace), the work the
counters report: every task's `bytes_read` on a compute resource (the decoder's dense tasks:
the weights of every layer and of the logits head, and the activations in; attention: the
KV each strategy actually attended and its query; "compute" tasks: digests and other
metadata a strategy counts as `bytes_read`) and every copy's `bytes_moved` per link. A
resource reads from a memory: "accel" from the accelerator's, "host" and "pnm" (kvbench runs
the PNM role on host memory and threads) from the host's; a link "h2d"/"d2h" (a suffixed
one such as scout's "h2d.recall" is that link) moves over its own engine. Each term is its
bytes over that memory's or link's measured GB/s; terms on the same memory add (they share
its bandwidth), memories and links that work in parallel (a GPU's memory, the host's, each
copy direction) overlap: the bound is the largest of their sums, the shortest time any
schedule of the step could take. On a CPU-only run every term is host memory (the
accelerator role is the CPU; its "copies" are memcpys), so the terms add up. A link with no
measured bandwidth ("pnm_reduce", "cxl") is not bounded: its bytes are listed, not timed.

Bandwidth (`Bandwidth`) comes from either
    "probe"        measured in the run itself after its decode steps (kvbench's native read
                   loop and memcpy on the run's threads over `buffer_bytes`, the attention
                   probe's read and copy machinery; with CUDA a device copy counted read
                   plus written and pinned copies each way), so peak memory is not touched;
                   taken again, the highest reading kept, when it bounded steps that read
                   past the caches below their own rate (`probe_bounding`);
    "calibration"  this machine's stored `kvbench calibrate` records (the attention probe's
                   host_read_gbps at its largest size, the roofline's cuda:0 memory_gbps,
                   the bandwidth probe's curves at their largest size).
Records: `step_bytes` (per memory or link, counted: the bytes alone, free of the probe's
run-to-run noise, for comparing strategies), `step_bound_s` (per decode step,
informational) and `step_efficiency` (per step its bound over its measured time; higher is
better, 1 is the bytes bound).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvbench.errors import KvbenchError, require
from kvbench.schema import ParamValue, Record, measured, not_measured
from kvbench.timing import Policy

SOURCES = ("probe", "calibration")
MEMORY = {"accel": "accel", "host": "host", "pnm": "host"}  # resource -> memory it reads
PROBE_POLICY = Policy(warmup=1, min_reps=5, min_time_s=0.05, max_reps=20, max_time_s=0.5)


@dataclass(frozen=True)
class Bandwidth:
    """Measured GB/s (decimal) of "accel" and "host" memory reads and of the links, `shared`
    when the accelerator role is the CPU (one memory: every term adds), where they came from
    (`source`, one of SOURCES, and `how` per quantity)."""

    gbps: dict[str, float]
    shared: bool
    source: str
    how: dict[str, str] = field(default_factory=dict)

    def rate(self, what: str) -> tuple[float | None, str]:
        """(GB/s or None when not measured, the memory or link it occupies) of a resource
        ("accel", "host", "pnm") or a link ("h2d", "h2d.recall", ...)."""
        if what in MEMORY:
            memory = MEMORY[what]
            return self.gbps.get(memory), "host" if self.shared else memory
        link = what.split(".")[0]
        return self.gbps.get(link), "host" if self.shared else link


def step_bytes(tasks: list[Any]) -> dict[str, float]:
    """Bytes of one step's tasks: read per compute resource, moved per link."""
    out: dict[str, float] = defaultdict(float)
    for t in tasks:
        if t.resource in MEMORY:
            out[t.resource] += float(t.work.get("bytes_read", 0.0))
        else:
            out[t.resource] += float(t.work.get("bytes_moved", 0.0))
    return {k: v for k, v in out.items() if v}


def bound(nbytes: dict[str, float], bw: Bandwidth
          ) -> tuple[float, dict[str, float], dict[str, float]]:
    """(bound seconds, seconds per memory or link, unbounded bytes per link) of one step's
    bytes (`step_bytes`): per memory the sum of its terms, the bound their maximum."""
    busy: dict[str, float] = defaultdict(float)
    unbounded: dict[str, float] = {}
    for what, n in nbytes.items():
        gbps, memory = bw.rate(what)
        if gbps is None:
            unbounded[what] = n
        else:
            busy[memory] += n / (gbps * 1e9)
    return max(busy.values(), default=0.0), dict(busy), unbounded


def per_step(graph: Any, n: int) -> list[dict[str, float]]:
    """`step_bytes` of decode steps 1..n of the run's stage graph."""
    by_step = graph.steps()
    return [step_bytes(by_step.get(s, [])) for s in range(1, n + 1)]


def probe_bounding(cuda: bool, threads: int, steps: list[float],
                   per: list[dict[str, float]], tries: int = 3) -> Bandwidth:
    """`probe`, taken again (`tries` probes at most) while decode steps that read past every
    cache (a median step over twice the last-level cache) ran faster than the bound it
    gives: a probe slower than the steps' own reads caught the machine in a stall (on the
    2-core VM once 16.8 GB/s, after steps that had read at 36), not its bandwidth. Each
    quantity then takes its highest reading and `how` says so. Steps within the caches may
    beat a memory bound; their probe is taken once."""
    from kvbench.memory import llc_bytes

    bw = probe(cuda, threads)
    if not steps or statistics.median(sum(b.values()) for b in per) <= 2 * llc_bytes():
        return bw
    first = dict(bw.gbps)
    for n in range(2, tries + 1):
        if statistics.median(bound(b, bw)[0] / s for b, s in zip(per, steps, strict=True)) <= 1:
            break
        again = probe(cuda, threads)
        bw = Bandwidth({k: max(v, again.gbps.get(k, v)) for k, v in bw.gbps.items()},
                       bw.shared, bw.source,
                       {k: f"{h}; the highest of {n} probes (the first, {first[k]:.3g} "
                           "GB/s, bounded the steps below their own rate)"
                        for k, h in again.how.items()})
    return bw


def records(name: str, params: dict[str, ParamValue], steps: list[float],
            per: list[dict[str, float]], bw: Bandwidth | str) -> Iterator[Record]:
    """`step_bytes` per memory and link (counted: what the step reads and moves, which
    no bandwidth's noise touches; compare strategies by these), `step_bound_s` and
    `step_efficiency` of the decode steps (seconds `steps`, their bytes `per`: `per_step`);
    `bw` a reason string when no bandwidth was measured."""
    keys = sorted({k for b in per for k in b})
    for k in [*keys, "total"]:
        yield measured("run", name, "step_bytes", "B", "lower",
                       [sum(b.values()) if k == "total" else b.get(k, 0.0) for b in per],
                       {**params, "where": k},
                       {"per": "decode step: bytes its counters read from this memory or "
                               "move over this link (counted, not timed); total: every "
                               "memory and link"})
    if isinstance(bw, str):
        for metric in ("step_bound_s", "step_efficiency"):
            yield not_measured("run", name, metric, "waived", bw, params)
        return
    bounds = [bound(b, bw) for b in per]
    med = {k: statistics.median(b.get(k, 0.0) for b in per) for k in keys}
    busy = {m: statistics.median(x[1].get(m, 0.0) for x in bounds)
            for m in sorted({m for x in bounds for m in x[1]})}
    unbounded = sorted({k for x in bounds for k in x[2]})
    method = {"per": "decode step: bytes read per memory and moved per link (the run's "
                     "counters) / measured GB/s; summed per memory, the largest memory's",
              "statistic": "median", "bandwidth_source": bw.source,
              "gbps": dict(bw.gbps), "how": dict(bw.how),
              "bytes_per_step": med, "seconds_per_step": busy,
              "one_memory": bw.shared}
    if unbounded:
        method["unbounded"] = {k: med[k] for k in unbounded}
        method["unbounded_note"] = "no measured bandwidth: these bytes are not in the bound"
    rec = measured("run", name, "step_bound_s", "s", "none", [b[0] for b in bounds], params,
                   method)
    yield rec
    yield measured("run", name, "step_efficiency", "ratio", "higher",
                   [b[0] / s for b, s in zip(bounds, steps, strict=True)], params,
                   {"per": "decode step: its step_bound_s / its measured time (tbt)",
                    "statistic": "median", "bandwidth_source": bw.source,
                    "step_bound_s": rec.value, "gbps": dict(bw.gbps)})


def describe(recs: list[Record]) -> str:
    """One line on the step bound of a run's records ('' when it was not measured): bytes
    per step per resource and link at the GB/s they were bounded by, the bandwidth's source,
    the bound and the efficiency."""
    from kvbench.units import format_bytes, format_seconds

    got = {r.metric: r for r in recs if r.metric in ("step_bound_s", "step_efficiency")
           and r.status == "ok"}
    if len(got) < 2:
        return ""
    m = got["step_bound_s"].method
    rates = m["gbps"]
    terms = ", ".join(
        f"{k} {format_bytes(v)} at " + (f"{rates[x]:.3g} GB/s" if (x := MEMORY.get(
            k, k.split(".")[0])) in rates else "(not bounded)")
        for k, v in m["bytes_per_step"].items())
    return (f"bytes bound per decode step: {terms} ({m['bandwidth_source']}"
            f"{', one memory' if m['one_memory'] else ''}) = "
            f"{format_seconds(got['step_bound_s'].value or 0)}; step efficiency "
            f"{got['step_efficiency'].value:.2f} of it")


def probe(cuda: bool, threads: int) -> Bandwidth:
    """Measure the run's bandwidths now (module docstring, "probe"); KvbenchError when the
    native library is not built."""
    import torch

    from kvbench.native import lib
    from kvbench.timing import time_native
    from kvbench.units import gbps

    so = lib()
    n = buffer_bytes()
    buf = torch.ones(n, dtype=torch.uint8)
    half = n // 2
    read = time_native(lambda: so.kvb_read_threads(buf.data_ptr(), n, 1, threads) * 1e-9,
                       PROBE_POLICY)
    rates = {"host": gbps(n, read.median)}
    how = {"host": f"native read loop over {n >> 20} MiB on {threads} threads, median of "
                   f"{len(read.seconds)}"}
    if not cuda:
        copy = time_native(lambda: so.kvb_memcpy_threads(
            buf.data_ptr() + half, buf.data_ptr(), half, 1, threads) * 1e-9, PROBE_POLICY)
        rates |= {"accel": rates["host"], "h2d": gbps(half, copy.median),
                  "d2h": gbps(half, copy.median)}
        how |= {"accel": "the host's (no GPU: the accelerator role is the CPU)",
                "h2d": f"native memcpy of {half >> 20} MiB on {threads} threads (bytes "
                       f"once), median of {len(copy.seconds)}", "d2h": "as h2d"}
        return Bandwidth(rates, True, "probe", how)
    from kvbench.timing import time_cuda

    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(dev)
    pinned = buf[:half].pin_memory()
    t = time_cuda(lambda: dst.copy_(dev), PROBE_POLICY)
    rates["accel"] = gbps(2 * n, t.median)
    how["accel"] = (f"device copy of {n >> 20} MiB counted read plus written (the memory "
                    f"traffic), CUDA events, median of {len(t.seconds)}")
    for link, fn in (("h2d", lambda: dev[:half].copy_(pinned, non_blocking=True)),
                     ("d2h", lambda: pinned.copy_(dev[:half], non_blocking=True))):
        t = time_cuda(fn, PROBE_POLICY)
        rates[link] = gbps(half, t.median)
        how[link] = f"pinned copy of {half >> 20} MiB, CUDA events, median of {len(t.seconds)}"
    return Bandwidth(rates, False, "probe", how)


def buffer_bytes() -> int:
    """Bytes the probe reads: four times the last-level cache, at least 64 MiB and at most
    the attention probe's copy size (past every cache either way)."""
    from kvbench.memory import llc_bytes
    from kvbench.probes.attention import COPY_BYTES

    return int(min(COPY_BYTES, max(64 << 20, 4 * llc_bytes())))


def _largest(found: list[dict[str, Any]], key: str) -> tuple[float, dict[str, Any]] | None:
    """(median value at the largest params[key], one such record) of ok records."""
    ok = [r for r in found if r.get("status") == "ok" and r.get("value") is not None]
    if not ok:
        return None
    top = max(r["params"].get(key, 0) for r in ok)
    at = [r for r in ok if r["params"].get(key, 0) == top]
    return statistics.median(r["value"] for r in at), at[0]


def from_calibration(records: list[dict[str, Any]], cuda: bool, where: str) -> Bandwidth:
    """The bandwidths of this machine's stored calibration records (`where`: their file);
    KvbenchError naming what it lacks."""
    rates: dict[str, float] = {}
    how: dict[str, str] = {}

    def take(key: str, probe: str, metric: str, size: str, what: str, **want: Any) -> None:
        found = _largest([r for r in records if r.get("name") == probe
                          and r.get("metric") == metric and r.get("status") == "ok"
                          and all(r["params"].get(k, v if k == "engine" else None) == v
                                  for k, v in want.items())], size)
        if found is None:
            raise KvbenchError(f"--bandwidth calibration: the calibration in {where} has no "
                               f"{what}: rerun `kvbench calibrate`")
        rates[key], rec = found
        how[key] = (f"calibration: {probe} {metric} at {size} {rec['params'][size]} "
                    f"({rec.get('time') or 'time unknown'})")

    take("host", "attention", "host_read_gbps", "bytes", "attention host_read_gbps")
    gpu, memory = ("gpu:0", "pinned") if cuda else ("host:0", "pageable")
    for link, src, dst in (("h2d", "host:0", gpu), ("d2h", gpu, "host:0")):
        take(link, "bandwidth", "bandwidth", "size", f"{src} -> {dst} {memory} bandwidth "
             "curve", src=src, dst=dst, memory=memory, engine="torch")
    if cuda:
        take("accel", "roofline", "memory_gbps", "bytes", "roofline memory_gbps on cuda:0",
             device="cuda:0")
    else:
        rates["accel"] = rates["host"]
        how["accel"] = "the host's (no GPU: the accelerator role is the CPU)"
    return Bandwidth(rates, not cuda, "calibration", how)


def stored(cuda: bool) -> Bandwidth:
    """This machine's stored calibration (kvbench.hwmodel.calibrate) as a Bandwidth;
    KvbenchError (one line) when there is none or it lacks a quantity."""
    from kvbench.envinfo import collect_env
    from kvbench.hwmodel import calibrate

    try:
        records = calibrate.stored()
    except KvbenchError as e:  # its lines name the option that asked: say ours
        raise KvbenchError(str(e).replace("--hardware this", "--bandwidth calibration")
                           .replace(" (or pass --probes FILE)", "")) from None
    folder = calibrate.home()
    require(folder is not None, "--bandwidth calibration: KVBENCH_CACHE=off")
    path = folder / calibrate.machine_key(collect_env()) / calibrate.RECORDS
    return from_calibration(records, cuda, str(path))
