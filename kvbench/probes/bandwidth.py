"""Bandwidth probe: copy bandwidth between every pair of memories against size (issue 3).

Reproduces the measurement of the CXL KV-storage paper, section 3.1 / Fig. 1a (copies
between host buffers placed on a NUMA node, CXL memory-only nodes included, and the GPU,
1 KB to 256 MB) for every pair the machine has: host-to-host in pinned native threads,
host-to-device, device-to-host and device-to-device through torch CUDA timed with CUDA
events behind a device-side wait. Pinned host memory is the node's buffer registered with
cudaHostRegister; pageable is the same buffer unregistered. Per pair it derives the peak,
the size reaching 90% of it, the half-bandwidth size and the small-copy latency floor, and
measures its bars against plain memcpy loops, the PCIe link and a bare torch copy loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from kvbench.errors import KvbenchError
from kvbench.probes import PROBES, Probe
from kvbench.probes._copy import (
    GpuCopier,
    HostCopier,
    Pair,
    Plan,
    host_memcpy_ref,
    make_plan,
    open_copier,
)
from kvbench.schema import Record, measured, not_measured
from kvbench.timing import DEFAULT, QUICK, Policy
from kvbench.units import format_size, gbps

BAR_SIZE = 256 << 20
DEFAULT_SIZES = "1K..256M"


@dataclass(frozen=True)
class BandwidthConfig:
    src: str | None = None  # endpoints 'host:N'/'gpu:K', comma-separated; None: all
    dst: str | None = None
    sizes: str = DEFAULT_SIZES
    memory: str = "both"  # pageable, pinned or both
    threads: int = 1
    bidirectional: bool = False
    bars: bool = True
    quick: bool = False
    root: str = "/"


def at_fraction(sizes: Sequence[int], values: Sequence[float], frac: float) -> float:
    """Smallest size whose bandwidth reaches frac x peak, interpolated in log2(size) between
    the swept sizes around the crossing (the first swept size if it already reaches it)."""
    target = frac * max(values)
    for i, v in enumerate(values):
        if v >= target:
            if i == 0:
                return float(sizes[0])
            lo, hi = math.log2(sizes[i - 1]), math.log2(sizes[i])
            t = (target - values[i - 1]) / (v - values[i - 1])
            return 2 ** (lo + t * (hi - lo))
    raise ValueError("no value reaches the peak")  # unreachable: max(values) reaches it


def derived(name: str, sizes: list[int], gbs: list[float], params: dict[str, Any]
            ) -> list[Record]:
    """Peak, 90%-of-peak size, half-bandwidth size and latency floor of one pair's sweep
    (medians per size, GB/s); measured-derived, so provenance stays 'measured'."""
    how = "derived from this run's median bandwidth per size"
    floor_us = min(s / (g * 1e9) for s, g in zip(sizes, gbs, strict=True)) * 1e6
    rows = [("peak_bandwidth", "GB/s", "higher", max(gbs), "max over sizes"),
            ("size_90pct_peak", "B", "lower", at_fraction(sizes, gbs, 0.9),
             "smallest size reaching 90% of peak, log2-interpolated"),
            ("half_bandwidth_size", "B", "lower", at_fraction(sizes, gbs, 0.5),
             "smallest size reaching 50% of peak (n1/2), log2-interpolated"),
            ("latency_floor", "us", "lower", floor_us, "min over sizes of size / bandwidth")]
    return [measured("probe", name, metric, unit, direction,  # type: ignore[arg-type]
                     [value], params, {"derived": f"{rule}; {how}"})
            for metric, unit, direction, value, rule in rows]


@PROBES.register
class BandwidthProbe(Probe):
    """Copy bandwidth between every pair of memories (host nodes, CXL, GPUs) against size."""

    name = "bandwidth"
    version = "1"
    config = BandwidthConfig

    def run(self, config: BandwidthConfig) -> Iterator[Record]:
        if config.threads < 1:
            raise KvbenchError(f"--threads must be at least 1 (got {config.threads})")
        plan = make_plan(config.src, config.dst, config.sizes, config.memory, config.root)
        policy = QUICK if config.quick else DEFAULT
        common = {"threads": config.threads, "bidirectional": config.bidirectional}
        for s, d in plan.waived_pairs:
            yield not_measured("probe", self.name, "bandwidth", "waived", "no CUDA GPU on this "
                               "machine", {"src": s, "dst": d, **common})
        for pair in plan.pairs:
            top: dict[str, float] = {}
            for kind in plan.waived_kinds if pair.direction != "d2d" else []:
                yield not_measured("probe", self.name, "bandwidth", "waived", "pinned memory "
                                   "needs CUDA (cudaHostRegister)",
                                   {"src": str(pair.src), "dst": str(pair.dst), "memory": kind,
                                    **common})
            for kind in plan.kinds_of(pair):
                params = {"src": str(pair.src), "dst": str(pair.dst),
                          "direction": pair.direction, "memory": kind, **common}
                copier = open_copier(pair, kind, plan.sizes[-1], config.threads,
                                     config.bidirectional, config.root)
                try:
                    recs = []
                    for size in plan.sizes:
                        recs.append(self._point(copier, size, policy, params))
                        yield recs[-1]
                    gbs = [r.value for r in recs]
                    top[kind] = gbs[-1]  # type: ignore[assignment]
                    yield from derived(self.name, plan.sizes, gbs, params)  # type: ignore[arg-type]
                    yield from self._cv(recs, params)
                    if config.bars and isinstance(copier, GpuCopier) and kind == "pinned" \
                            and pair.direction == "h2d":
                        yield from self._gpu_bars(copier, pair, policy, params, config.root)
                finally:
                    copier.close()
            if {"pageable", "pinned"} <= top.keys():
                ratio = top["pageable"] / top["pinned"]
                yield measured("probe", self.name, "pageable_pinned_ratio", "ratio", "higher",
                               [ratio], {"src": str(pair.src), "dst": str(pair.dst),
                                         "size": plan.sizes[-1], **common},
                               {"derived": "pageable / pinned median bandwidth at the largest "
                                           "size of this run"})
        if config.bars:
            yield from self._memcpy_bar(plan, config, policy)

    def _point(self, copier: HostCopier | GpuCopier, size: int, policy: Policy,
               params: dict[str, Any]) -> Record:
        t = copier.timing(size, policy)
        nbytes = copier.bytes_per_copy(size)
        method = {**t.method(), "placement": copier.placement, "span": copier.span}
        if isinstance(copier, HostCopier):
            method["cpus"] = ",".join(map(str, copier.cpus)) or "unpinned"
        else:
            method["before"] = "torch.cuda._sleep queued ahead of the start event"
        return measured("probe", self.name, "bandwidth", "GB/s", "higher",
                        [gbps(nbytes, s) for s in t.seconds], {**params, "size": size}, method)

    def _cv(self, recs: list[Record], params: dict[str, Any]) -> Iterator[Record]:
        cvs = [r.stats["cv"] for r in recs if r.stats and int(r.params["size"]) >= 1 << 20]  # type: ignore[arg-type]
        if cvs:
            yield measured("probe", self.name, "cv_median_ge_1m", "ratio", "lower",
                           [sorted(cvs)[len(cvs) // 2]], params,
                           {"derived": "median over sizes >= 1M of the per-size coefficient "
                                       "of variation", "bar": "< 0.05 on an idle machine"})

    def _memcpy_bar(self, plan: Plan, config: BandwidthConfig, policy: Policy
                    ) -> Iterator[Record]:
        """Probe vs a plain C memcpy loop on the same buffers, 256M, rounds interleaved."""
        from kvbench.native import lib

        same = [p for p in plan.pairs if p.direction == "h2h" and p.src == p.dst]
        ref = "kvb_memcpy_loop" if config.threads == 1 else "kvb_memcpy_threads"
        params = {"node": str(same[0].src) if same else None, "size": BAR_SIZE,
                  "threads": config.threads, "reference": ref}
        if not same:
            yield not_measured("probe", self.name, "memcpy_ratio", "waived",
                               "no same-node host pair in this run", params)
            return
        copier = HostCopier(same[0], "pageable", BAR_SIZE, config.threads, False, config.root)
        try:
            sample = copier.sampler(BAR_SIZE)
            sb, db, _ = copier.routes[0]
            rounds = 2 * policy.min_reps + 1
            probe_s, ref_s = [], []
            for i in range(rounds + 1):
                p, r = sample(1), host_memcpy_ref(lib(), db.ptr, sb.ptr, BAR_SIZE, config.threads)
                if i:  # round 0 warms both up
                    probe_s.append(p)
                    ref_s.append(r)
        finally:
            copier.close()
        ratios = [r / p for p, r in zip(probe_s, ref_s, strict=True)]
        med = sorted(ratios)[len(ratios) // 2]
        yield measured("probe", self.name, "memcpy_ratio", "ratio", "higher", ratios, params, {
            "timer": "CLOCK_MONOTONIC (native)", "reps": rounds, "statistic": "median",
            "per": "probe / reference bandwidth, one ratio per interleaved round",
            "probe_gbps": gbps(BAR_SIZE, sorted(probe_s)[rounds // 2]),
            "reference_gbps": gbps(BAR_SIZE, sorted(ref_s)[rounds // 2]),
            "bar": ">= 0.9", "pass": med >= 0.9, "placement": copier.placement})

    def _gpu_bars(self, copier: GpuCopier, pair: Pair, policy: Policy, params: dict[str, Any],
                  root: str) -> Iterator[Record]:
        """Pinned H2D at 256M against the NVML PCIe link rate and a bare torch copy loop."""
        from kvbench.envinfo import gpu_info

        size = min(BAR_SIZE, copier.span)
        bw = gbps(size, copier.timing(size, policy).median)
        loop = copier.torch_loop_gbps(size)
        p = {**params, "size": size}
        yield measured("probe", self.name, "torch_loop_ratio", "ratio", "higher",
                       [bw / g for g in loop], p,
                       {"per": "probe / bare torch pinned copy loop (same buffers)",
                        "probe_gbps": bw, "bar": "within 10% (>= 0.9)"})
        gpus, _ = gpu_info(Path(root))
        link = next((g.get("pcie_link_gbps_max") for g in gpus if g["index"] == pair.dst.index),
                    None)
        if not link:
            yield not_measured("probe", self.name, "pcie_link_ratio", "waived",
                               "NVML does not report the PCIe link of this GPU", p)
            return
        yield measured("probe", self.name, "pcie_link_ratio", "ratio", "higher", [bw / link], p,
                       {"derived": "pinned H2D bandwidth / NVML max PCIe link rate",
                        "probe_gbps": bw, "link_gbps": link, "bar": ">= 0.8"})

    @classmethod
    def plot(cls, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
        """bandwidth.png: copy time and bandwidth against size, one line per pair and memory
        kind, log-scaled size axis (the two panels of the CXL paper's Fig. 1a)."""
        from kvbench.plots import pyplot, save

        lines = series(records, cls.name, "bandwidth")
        if not lines:
            return []
        plt = pyplot()
        fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
        for label, pts in lines.items():
            xs = [s for s, _ in pts]
            ax_b.plot(xs, [g for _, g in pts], marker="o", label=label)
            ax_t.plot(xs, [s / (g * 1e9) * 1e6 for s, g in pts], marker="o", label=label)
        for ax, ylabel in ((ax_t, "copy time (us)"), (ax_b, "bandwidth (GB/s)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("copy size")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ticks = sorted({s for pts in lines.values() for s, _ in pts})
            ax.set_xticks(ticks, [format_size(s) for s in ticks], rotation=45)
        ax_t.set_yscale("log")
        ax_b.set_ylim(bottom=0)
        ax_b.legend(fontsize=7)
        fig.suptitle("Copy time and bandwidth against size (cf. CXL KV-storage paper Fig. 1a)")
        return [save(fig, out_dir / "bandwidth.png")]


def series(records: list[dict[str, Any]], name: str, metric: str
           ) -> dict[str, list[tuple[int, float]]]:
    """'src->dst memory' -> [(size, value)] sorted by size, for ok records of name/metric."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        p = r.get("params") or {}
        if r["name"] != name or r["metric"] != metric or r["status"] != "ok" or "size" not in p:
            continue
        label = f"{p['src']}->{p['dst']} {p.get('memory', '')}".strip()
        if p.get("bidirectional"):
            label += " bidir"
        out.setdefault(label, []).append((int(p["size"]), float(r["value"])))
    return {k: sorted(v) for k, v in out.items()}


def memory_flag(pinned: bool, pageable: bool, both: bool) -> str:
    """The one memory kind the --pinned/--pageable/--both flags ask for (default both)."""
    chosen = [k for k, on in (("pinned", pinned), ("pageable", pageable), ("both", both)) if on]
    if len(chosen) > 1:
        raise KvbenchError("use only one of --pinned, --pageable, --both")
    return chosen[0] if chosen else "both"


def cli(
    src: str | None = typer.Option(None, help="Source endpoints host:N / gpu:K, comma-separated "
                                   "(default: every host node and GPU)."),
    dst: str | None = typer.Option(None, help="Destination endpoints (default: all)."),
    sizes: str = typer.Option(DEFAULT_SIZES, help="Copy sizes: 1K,4K,...,256M or 1K..256M."),
    pinned: bool = typer.Option(False, "--pinned", help="Pinned host memory only (needs CUDA)."),
    pageable: bool = typer.Option(False, "--pageable", help="Pageable host memory only."),
    both: bool = typer.Option(False, "--both", help="Pinned and pageable (the default)."),
    threads: int = typer.Option(1, help="Copy threads per direction for host-to-host pairs."),
    bidirectional: bool = typer.Option(False, "--bidirectional",
                                       help="Copy both ways at once (bytes of both counted)."),
    bars: bool = typer.Option(True, help="Also measure the bars (memcpy, PCIe, torch loop)."),
    quick: bool = typer.Option(False, "--quick", help="Fewer repetitions (quick look, CI)."),
    root: str = typer.Option("/", hidden=True, help="Root of sysfs/procfs (tests)."),
    out: Path | None = typer.Option(None, help="Result file (default: new file in results/)."),
) -> None:
    """Measure copy bandwidth between every pair of memories against size."""
    from kvbench.probes._view import run_with_view

    config = BandwidthConfig(src=src, dst=dst, sizes=sizes,
                             memory=memory_flag(pinned, pageable, both), threads=threads,
                             bidirectional=bidirectional, bars=bars, quick=quick, root=root)
    run_with_view(BandwidthProbe(), config, out, "bandwidth (GB/s)", "bandwidth",
                  make_plan(src, dst, sizes, config.memory, root).steps)


BandwidthProbe.cli = cli
