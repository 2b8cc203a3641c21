"""Latency probe: the cost of one small copy per memory pair, and each node's load latency.

Small copies (1 B to 64 KB) between every pair of memories: host-to-host in native code,
one thread, each copy fenced and its successor's address made dependent on its data, over
line-aligned windows visited in a scattered order, so the figure is one isolated cold copy
rather than a pipelined rate; copies touching a GPU are host wall time from enqueue to
completion. The idle load-to-use latency of each host node (memory-only CXL nodes driven
from their nearest CPUs) is a pointer chase over a random cyclic permutation of cache lines
in a buffer four times the last-level cache, with dependent loads (CXL KV-storage paper,
section 3.1; issue 3).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.memory import Endpoint, HostBuffer, llc_bytes, runner_cpus, runner_node
from kvbench.options import opt
from kvbench.probes import PROBES, Measure, Probe, RecordOf, in_passes
from kvbench.probes._copy import calibrated, make_plan, open_copier
from kvbench.probes.bandwidth import CopyPairs, series
from kvbench.schema import Record, measured, not_measured
from kvbench.timing import DEFAULT, QUICK, Timing
from kvbench.units import format_size, parse_size

DEFAULT_SIZES = "1..64K"
LINE = 64


@dataclass(frozen=True)
class LatencyConfig(CopyPairs):
    """Options of `kvbench probe latency` (and of a suite's latency case)."""

    sizes: str = opt(DEFAULT_SIZES, "Copy sizes: 1,4,...,64K or 1..64K.")
    chase_size: str | None = opt(None, "Pointer-chase buffer per node (default: max(4 x "
                                 "LLC, 64M)).")
    quick: bool = opt(False, "Fewer repetitions (quick look, CI).")


def chase_bytes(config: LatencyConfig) -> int:
    if config.chase_size is not None:
        return max(parse_size(config.chase_size) // LINE, 2) * LINE
    return max(4 * llc_bytes(config.root), 64 << 20)


@PROBES.register
class LatencyProbe(Probe):
    """Cost of one small copy per memory pair, and each host node's load-to-use latency."""

    name = "latency"
    version = "1"
    config = LatencyConfig
    description = "Measure small-copy latency per memory pair and each node's load latency."
    record_params = ("direction", "size", "node")

    @classmethod
    def command(cls, config: LatencyConfig, out: Path | None) -> None:
        """A live table of the latencies while the sweep runs (kvbench.probes._view)."""
        from kvbench.probes._view import run_with_view

        plan = make_plan(config.src, config.dst, config.sizes, config.memory, config.root)
        chase_bytes(config)  # a bad --chase-size fails before anything runs
        run_with_view(cls(), config, out, "copy latency (us)", "copy_latency", plan.steps)

    def run(self, config: LatencyConfig) -> Iterator[Record]:
        """Each pair and memory kind's sizes timed together in passes (time_passes), the
        first with every node's pointer chase among them."""
        plan = make_plan(config.src, config.dst, config.sizes, config.memory, config.root)
        policy = QUICK if config.quick else DEFAULT
        nodes = sorted({e.index for p in plan.pairs for e in (p.src, p.dst) if e.kind == "host"})
        yield from plan.waived(self.name, "copy_latency", {})
        with ExitStack() as stack:
            todo: list[tuple[Measure, RecordOf]] = []
            for node in nodes:
                got = self._chase(node, chase_bytes(config), config.root, stack)
                if isinstance(got, Record):
                    yield got
                else:
                    todo.append(got)
            for pair in plan.pairs:
                for kind in plan.kinds_of(pair):
                    copier = open_copier(pair, kind, plan.sizes[-1], 1, False, config.root)
                    try:
                        params = {"src": str(pair.src), "dst": str(pair.dst),
                                  "direction": pair.direction, "memory": kind}
                        per = ("one isolated copy" if pair.direction == "h2h"
                               else "enqueue to completion (stream synchronize)")
                        todo += [(copier.measure(size, latency=True),
                                  self._copy_record({**params, "size": size}, copier.placement,
                                                    per)) for size in plan.sizes]
                        yield from in_passes(todo, policy)
                    finally:
                        copier.close()
                    todo = []
            yield from in_passes(todo, policy)

    def _copy_record(self, params: dict[str, Any], placement: str, per: str
                     ) -> RecordOf:
        def record(t: Timing) -> Record:
            return measured("probe", self.name, "copy_latency", "us", "lower",
                            [x * 1e6 for x in t.seconds], params,
                            {**t.method(), "placement": placement, "per": per})
        return record

    def _chase(self, node: int, size: int, root: str, stack: ExitStack
               ) -> Record | tuple[Measure, RecordOf]:
        """Pointer chase over size bytes on node, from a CPU of its runner node: (measure,
        record maker), or an error record. The buffer lives as long as `stack`."""
        from kvbench.native import lib

        so = lib()
        cpus = runner_cpus(node, root)
        cpu = cpus[0] if cpus else -1
        params = {"node": str(Endpoint("host", node)), "size": size}
        buf = stack.enter_context(HostBuffer(node, size, hugepages=True))
        if so.kvb_chase_build(buf.ptr, size // LINE, LINE, 0x9E3779B97F4A7C15) != 0:
            return not_measured("probe", self.name, "load_latency", "error",
                                "out of memory building the chase", params)
        cursor = ctypes.c_void_p(buf.ptr)

        def sample(iters: int) -> float:
            loads = (max(iters, 64) + 7) // 8 * 8  # the C loop does 8 per step
            return so.kvb_chase(ctypes.byref(cursor), loads, cpu) * 1e-9 / loads

        method = {"placement": buf.placement, "cpu": cpu,
                  "runner_node": runner_node(node, root).id,
                  "per": "dependent load over a random cyclic permutation of "
                         f"{LINE}-byte lines (transparent huge pages advised)"}

        def record(t: Timing) -> Record:
            return measured("probe", self.name, "load_latency", "ns", "lower",
                            [x * 1e9 for x in t.seconds], params, {**t.method(), **method})
        return calibrated(sample), record

    @classmethod
    def plot(cls, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
        """latency.png: small-copy latency against size per pair and memory kind (log-log),
        and the pointer-chase load latency of each host node."""
        from kvbench.plots import pyplot, save

        lines = series(records, cls.name, "copy_latency")
        chase = [(r["params"]["node"], r["value"]) for r in records
                 if r["name"] == cls.name and r["metric"] == "load_latency" and r["status"] == "ok"]
        if not lines and not chase:
            return []
        plt = pyplot()
        fig, (ax_c, ax_l) = plt.subplots(1, 2, figsize=(11, 4),
                                         gridspec_kw={"width_ratios": [3, 1]})
        for label, pts in lines.items():
            ax_c.plot([s for s, _ in pts], [v for _, v in pts], marker="o", label=label)
        ticks = sorted({s for pts in lines.values() for s, _ in pts})
        ax_c.set_xscale("log", base=2)
        ax_c.set_yscale("log")
        ax_c.set_xticks(ticks, [format_size(s) for s in ticks], rotation=45)
        ax_c.set(xlabel="copy size", ylabel="one copy (us)", title="small-copy latency")
        ax_c.grid(True, which="both", alpha=0.3)
        if lines:
            ax_c.legend(fontsize=7)
        ax_l.bar([n for n, _ in chase], [v for _, v in chase], color="tab:gray")
        ax_l.set(ylabel="load-to-use latency (ns)", title="pointer chase")
        return [save(fig, out_dir / "latency.png")]
