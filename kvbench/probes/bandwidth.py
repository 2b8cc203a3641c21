"""Bandwidth probe: copy bandwidth between every pair of memories against size (issue 3).

Reproduces the measurement of the CXL KV-storage paper, section 3.1 / Fig. 1a (copies
between host buffers placed on a NUMA node, CXL memory-only nodes included, and the GPU,
1 KB to 256 MB) for every pair the machine has: host-to-host in pinned native threads,
host-to-device, device-to-host and device-to-device through torch CUDA timed with CUDA
events behind a device-side wait, or (`--engine cupy`, the raw-CUDA reference for GPU
copies) by cudaMemcpyAsync through cupy with its own events (kvbench.probes._cupy). Pinned
host memory is the node's buffer registered with cudaHostRegister; pageable is the same
buffer unregistered. Per pair it derives the peak, the size reaching 90% of it, the
half-bandwidth size and the small-copy latency floor (kvbench.probes._bandwidth_stats), and
measures its bars against plain memcpy loops, the PCIe link and a bare torch copy loop
(pinned H2D in one direction with the torch engine: waived otherwise).

Host-to-host sizes are sampled in interleaved rounds, so each size's median spans the whole
sweep and drift of the machine's memory bandwidth moves every size alike; `repeat` sweeps N
times on fresh buffers and reports the issue's stability bar (median over sizes >= 1M of
each size's CV across sweeps). The step at 256M on the 2-core CI VM is glibc memcpy
switching to non-temporal stores (see kvbench.probes._copy); records say which stores ran.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError, require
from kvbench.options import check_ranges, opt
from kvbench.probes import PROBES, Probe
from kvbench.probes._bandwidth_stats import STABLE_SIZE, cv_by_size, derived, stability
from kvbench.probes._copy import (
    CupyCopier,
    HostCopier,
    Pair,
    Plan,
    host_memcpy_ref,
    make_plan,
    nt_threshold,
    open_copier,
)
from kvbench.probes._cupy import cupy_runtime
from kvbench.probes._gpu_copy import GpuCopier
from kvbench.schema import Record, measured, not_measured
from kvbench.timing import DEFAULT, QUICK, Policy
from kvbench.units import format_size, gbps

BAR_SIZE = 256 << 20
DEFAULT_SIZES = "1K..256M"
# Host sweeps: one sample per size per round until each size has had 1 s, so a size's median
# spans the whole sweep (~10 s for 10 sizes) rather than a 0.2 s window of its own: on the
# 2-core VM (load 4) the median of 2 ms samples moved 7% between 0.2 s windows, 2.5-3%
# between 5-10 s ones.
HOST_ROUNDS = Policy(warmup=1, min_reps=5, min_time_s=1.0)
ENGINES = ("torch", "cupy")
ROUNDS = "interleaved rounds: one sample of every size per round, direction alternating"


@dataclass(frozen=True)
class CopyPairs:
    """The memory pairs of a copy sweep: options of the bandwidth and latency probes."""

    src: str | None = opt(None, "Source endpoints host:N / gpu:K, comma-separated (default: "
                          "every host node and GPU).")
    dst: str | None = opt(None, "Destination endpoints (default: all).")
    memory: str = opt("both", "Host memory: pinned (needs CUDA), pageable or both.",
                      flags={"pinned": "pinned", "pageable": "pageable", "both": "both"})
    root: str = opt("/", "Root of sysfs/procfs (tests).", hidden=True)


@dataclass(frozen=True)
class BandwidthConfig(CopyPairs):
    """Options of `kvbench probe bandwidth` (and of a suite's bandwidth case)."""

    sizes: str = opt(DEFAULT_SIZES, "Copy sizes: 1K,4K,...,256M or 1K..256M.")
    threads: int = opt(1, "Copy threads per direction for host-to-host pairs.", min=1)
    bidirectional: bool = opt(False, "Copy both ways at once (bytes of both counted).")
    bars: bool = opt(True, "Also measure the bars (memcpy, PCIe, torch loop).")
    quick: bool = opt(False, "Fewer repetitions (quick look, CI).")
    repeat: int = opt(1, "Sweeps per pair and memory kind, fresh buffers each; 2 or more "
                      "adds repeat_cv_median_ge_1m, the stability bar.", min=1)
    engine: str = opt("torch", "GPU copies through torch (tensor copy_) or cupy "
                      "(cudaMemcpyAsync, the raw-CUDA reference; GPU bars only with torch).")

    def __post_init__(self) -> None:
        check_ranges(self)
        require(self.engine in ENGINES, f"--engine '{self.engine}': torch or cupy")


@PROBES.register
class BandwidthProbe(Probe):
    """Copy bandwidth between every pair of memories (host nodes, CXL, GPUs) against size."""

    name = "bandwidth"
    version = "3"
    config = BandwidthConfig
    description = "Measure copy bandwidth between every pair of memories against size."
    record_params = ("direction", "size", "node", "reference", "engine")

    @classmethod
    def command(cls, config: BandwidthConfig, out: Path | None) -> None:
        """A live table of the sweep's GB/s while it runs (kvbench.probes._view)."""
        from kvbench.probes._view import run_with_view

        plan = make_plan(config.src, config.dst, config.sizes, config.memory, config.root)
        run_with_view(cls(), config, out, "bandwidth (GB/s)", "bandwidth",
                      plan.steps * config.repeat)

    def run(self, config: BandwidthConfig) -> Iterator[Record]:
        if config.threads < 1:
            raise KvbenchError(f"--threads must be at least 1 (got {config.threads})")
        if config.repeat < 1:
            raise KvbenchError(f"--repeat must be at least 1 (got {config.repeat})")
        if config.engine == "cupy":
            cupy_runtime()  # a one-line error before any record where cupy is missing
        plan = make_plan(config.src, config.dst, config.sizes, config.memory, config.root)
        policy = QUICK if config.quick else DEFAULT
        load = os.getloadavg()[0]
        common = {"threads": config.threads, "bidirectional": config.bidirectional}
        yield from plan.waived(self.name, "bandwidth", common)
        for pair in plan.pairs:
            top: dict[str, float] = {}
            for kind in plan.kinds_of(pair):
                top[kind] = yield from self._pair_kind(pair, kind, plan, config, load)
            if {"pageable", "pinned"} <= top.keys():
                ratio = top["pageable"] / top["pinned"]
                yield measured("probe", self.name, "pageable_pinned_ratio", "ratio", "higher",
                               [ratio], {"src": str(pair.src), "dst": str(pair.dst),
                                         "size": plan.sizes[-1], **common},
                               {"derived": "pageable / pinned median bandwidth at the largest "
                                           "size of this run's last sweep"})
        if config.bars:
            yield from self._memcpy_bar(plan, config, policy)

    def _pair_kind(self, pair: Pair, kind: str, plan: Plan, config: BandwidthConfig,
                   load: float) -> Generator[Record, None, float]:
        """config.repeat sweeps of one pair and memory kind, each on fresh buffers (as a new
        run would have), with its derived records; then the across-repeat stability record.
        Returns the last sweep's median at the largest size."""
        params = {"src": str(pair.src), "dst": str(pair.dst), "direction": pair.direction,
                  "memory": kind, "threads": config.threads,
                  "bidirectional": config.bidirectional}
        if pair.direction != "h2h":
            params["engine"] = config.engine
        sweeps: list[dict[int, float]] = []
        for rep in range(config.repeat):
            copier = open_copier(pair, kind, plan.sizes[-1], config.threads,
                                 config.bidirectional, config.root, config.engine)
            try:
                host = isinstance(copier, HostCopier)
                policy = QUICK if config.quick else HOST_ROUNDS if host else DEFAULT
                recs = self._sweep(copier, plan.sizes, policy, params,
                                   f"{rep + 1}/{config.repeat}")
                yield from recs
                sweeps.append({s: r.value for s, r in zip(plan.sizes, recs,  # type: ignore[misc]
                                                          strict=True)})
                yield from derived(self.name, plan.sizes, list(sweeps[-1].values()), params)
                yield from stability(self.name, "cv_median_ge_1m", {
                    s: float((r.stats or {})["cv"]) for s, r in zip(plan.sizes, recs, strict=True)
                    if s >= STABLE_SIZE}, params, load, "per-size sample CV of this sweep", False)
                if rep == 0 and config.bars and kind == "pinned" and pair.direction == "h2d":
                    yield from self._gpu_bars(copier, pair, policy, params, config.root)
            finally:
                copier.close()
        if len(sweeps) > 1:
            yield from stability(self.name, "repeat_cv_median_ge_1m", cv_by_size(sweeps),
                                 params, load, f"per-size CV of the median across {len(sweeps)} "
                                 "repeated sweeps (fresh buffers each)", True)
        return sweeps[-1][plan.sizes[-1]]

    def _sweep(self, copier: HostCopier | GpuCopier | CupyCopier, sizes: list[int],
               policy: Policy, params: dict[str, Any], repeat: str) -> list[Record]:
        """One record per size: GB/s of every sample (copies per sample x bytes / seconds)."""
        recs = []
        for size, (t, iters) in copier.sweep(sizes, policy).items():
            method = {**t.method(), "placement": copier.placement, "span": copier.span,
                      "copies_per_sample": iters, "repeat": repeat}
            if isinstance(copier, HostCopier):
                method.update(cpus=",".join(map(str, copier.cpus)) or "unpinned",
                              cpus_per_thread=copier.cpus_per_thread,
                              order=ROUNDS, memcpy_stores=copier.stores(size),
                              nt_threshold=nt_threshold())
            else:
                method.update(order="one size after another", engine=params["engine"],
                              before="torch.cuda._sleep queued ahead of the start event")
            recs.append(measured("probe", self.name, "bandwidth", "GB/s", "higher",
                                 [gbps(copier.bytes_per_copy(size), s) for s in t.seconds],
                                 {**params, "size": size}, method))
        return recs

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
            "bar": ">= 0.9", "pass": med >= 0.9, "placement": copier.placement,
            "memcpy_stores": copier.stores(BAR_SIZE), "nt_threshold": nt_threshold(),
            "like_with_like": "both call glibc memcpy on the same per-thread lengths"})

    def _gpu_bars(self, copier: GpuCopier | CupyCopier, pair: Pair, policy: Policy,
                  params: dict[str, Any], root: str) -> Iterator[Record]:
        """Pinned H2D at 256M against the NVML PCIe link rate and a bare torch copy loop:
        one direction's rate of the torch engine, so waived for a bidirectional run (whose
        copies move both ways at once: audit finding #20) and for --engine cupy."""
        from kvbench.envinfo import gpu_info

        size = min(BAR_SIZE, copier.span)
        p = {**params, "size": size}
        why = ""
        if len(copier.routes) > 1:
            why = "the GPU bars compare one direction's rate: not measured with --bidirectional"
        elif not isinstance(copier, GpuCopier):
            why = "the GPU bars are measured with --engine torch"
        if why:
            for metric in ("torch_loop_ratio", "pcie_link_ratio"):
                yield not_measured("probe", self.name, metric, "waived", why, p)
            return
        bw = gbps(size, copier.timing(size, policy).median)
        loop = copier.torch_loop_gbps(size)
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
    """'src->dst memory' -> [(size, value)] sorted by size, for ok records of name/metric
    (one series per sweep of a --repeat run: 'sweep i/N' appended)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        p = r.get("params") or {}
        if r["name"] != name or r["metric"] != metric or r["status"] != "ok" or "size" not in p:
            continue
        label = f"{p['src']}->{p['dst']} {p.get('memory', '')}".strip()
        if p.get("engine", "torch") != "torch":
            label += f" {p['engine']}"
        if p.get("bidirectional"):
            label += " bidir"
        if not str((r.get("method") or {}).get("repeat", "1/1")).endswith("/1"):
            label += f" sweep {r['method']['repeat']}"
        out.setdefault(label, []).append((int(p["size"]), float(r["value"])))
    return {k: sorted(v) for k, v in out.items()}
