"""Attention probe: GPU, GPU-after-transfer, CPU dense/sparse and hybrid attention steps.

HGCA sections 2.3 (Fig. 6) and 5.1 (Figs. 10, 11): over a grid of batch, heads, KV heads,
head dim, tokens on the GPU, tokens on the host, query length and dtype, time each mode
(kvbench.kernels.workload) with its breakdown (transfer, gpu, cpu, merge) and KV-read GB/s,
and judge the kernels against bars measured in the same run: CPU dense decode vs the host
copy bandwidth, and in interleaved rounds vs torch SDPA and vs a read-only loop over as many
bytes (decode reads K and V once: the read bandwidth is its limit), sparse vs dense GB/s,
the merge's share of a hybrid step, GPU decode vs the device copy bandwidth (the copy's
bytes read plus written: the memory traffic, as the roofline's memory_gbps). Without CUDA
the GPU modes are waived. Device steps are timed GPU_CALLS calls per pair of CUDA events
behind a device-side wait that covers their launches (kvbench.timing.time_cuda's cover):
a torch attention step launches ~20 kernels, more host time than the device needs for
tens of MB of KV.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError, require
from kvbench.options import check_ranges, opt
from kvbench.probes import PROBES, Probe
from kvbench.schema import Record, from_timing, measured, not_measured
from kvbench.timing import (
    PASSES,
    Policy,
    Timing,
    each_pass,
    time_cuda,
    time_host,
    time_native,
    time_rounds,
)
from kvbench.units import gbps, parse_sizes

MODES = ("gpu", "gpu-transfer", "cpu-dense", "cpu-sparse", "hybrid")
GPU_ONLY = ("gpu", "gpu-transfer")
BIG_KV = 64 << 20  # the CPU dense bar applies from 64 MiB of KV
COPY_BYTES = 256 << 20
DEVICE_COPY_BYTES = 1 << 30
GPU_CALLS = 8  # calls of a device step per pair of CUDA events


@dataclass(frozen=True)
class AttentionConfig:
    """Options of `kvbench probe attention` (and of a suite's attention case)."""

    batch: str = opt("1", "Batch sizes, e.g. 1,4.")
    heads: str = opt("32", "Query heads.")
    kv_heads: str = opt("32", "KV heads (heads must be a multiple).")
    head_dim: str = opt("128", "Head dimensions.")
    gpu_tokens: str = opt("1K,4K", "KV tokens resident on the GPU.")
    host_tokens: str = opt("1K,4K", "KV tokens resident on the host.")
    query: str = opt("1,32", "Query lengths (1 decode, 32 append).")
    dtype: str = opt("float32,bfloat16", "float32, bfloat16, float16.")
    keep: float = opt(0.1, "Fraction of host KV the sparse CPU part keeps.")
    modes: str = opt("all", f"Modes: all or a list of {', '.join(MODES)}.")
    threads: int = opt(0, "CPU threads (0: every CPU available).", min=0)
    min_time: float = opt(0.2, "Seconds to time each quantity at least (over all passes).")
    passes: int = opt(PASSES, "Passes over the grid; each quantity's time is split among "
                      "them.", min=1)

    def __post_init__(self) -> None:
        check_ranges(self)


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",")]
    except ValueError:
        raise KvbenchError(f"cannot parse {what} '{text}' (expected e.g. 1,4,8)") from None
    require(all(v > 0 for v in vals), f"{what} must be positive, got '{text}'")
    return vals


def grid(config: AttentionConfig):
    """The grid points (validated) in measuring order."""
    from kvbench.kernels.workload import Point

    tokens = [(g, h) for g in parse_sizes(config.gpu_tokens)
              for h in parse_sizes(config.host_tokens)]
    pts = [Point(b, h, kv, d, g, ht, q, dt) for b, h, kv, d, (g, ht), q, dt in itertools.product(
        _ints(config.batch, "batch"), _ints(config.heads, "heads"),
        _ints(config.kv_heads, "kv heads"), _ints(config.head_dim, "head dim"), tokens,
        _ints(config.query, "query length"), [t.strip() for t in config.dtype.split(",")])]
    for p in pts:
        p.check()
    return pts


def modes(config: AttentionConfig, cuda: bool) -> list[str]:
    if config.modes == "all":
        return list(MODES)
    chosen = [m.strip() for m in config.modes.split(",")]
    for m in chosen:
        require(m in MODES, f"unknown mode '{m}' (known: {', '.join(MODES)}, all)")
        require(cuda or m not in GPU_ONLY, f"mode '{m}' needs a CUDA GPU and there is none")
    return chosen


def _groups(points: list, cuda: bool) -> list[list]:
    """Consecutive points whose workloads (kvbench.kernels.workload.Workload: host KV, and
    the whole KV on the device, on the CPU without CUDA) fit a quarter of the free host
    (and device) memory together: measured in passes side by side. A point over it is
    a group of its own."""
    import psutil

    host_free, dev_free = psutil.virtual_memory().available / 4, float("inf")
    if cuda:
        import torch

        dev_free = torch.cuda.mem_get_info()[0] / 4
    groups: list[list] = []
    used = (0.0, 0.0)
    for p in points:
        total = p.kv_bytes(p.host_tokens + p.gpu_tokens)
        need = (p.kv_bytes(p.host_tokens) + (0 if cuda else total), total if cuda else 0)
        if groups and used[0] + need[0] <= host_free and used[1] + need[1] <= dev_free:
            groups[-1].append(p)
            used = (used[0] + need[0], used[1] + need[1])
        else:
            groups.append([p])
            used = need
    return groups


@PROBES.register
class AttentionProbe(Probe):
    """Attention steps: GPU, GPU+transfer, CPU dense/sparse, hybrid (HGCA Figs. 6, 10, 11).

    Every quantity is timed in `passes` passes over the grid (a group of points that fits
    in memory at once), each taking 1/passes of its time, odd passes in reverse order: a
    machine whose speed drifts over seconds (a shared VM's memory bandwidth: +-25% between
    4 s windows on the 2-core VM, results/compare-noise) reaches every quantity alike, and
    records keep their samples' passes (`method.blocks`) for kvbench.compare to test."""

    name = "attention"
    version = "3"
    config = AttentionConfig
    description = "Time attention modes over a grid; plots Figs. 10 and 11 next to the result file."

    def run(self, config: AttentionConfig) -> Iterator[Record]:
        import torch

        from kvbench.kernels.cpu import default_threads
        from kvbench.kernels.workload import Workload

        require(0 < config.keep <= 1, f"keep fraction {config.keep} must lie in (0, 1]")
        require(config.min_time >= 0, "min-time must be >= 0")
        cuda = torch.cuda.is_available()
        points, chosen = grid(config), modes(config, cuda)
        timed = [m for m in chosen if cuda or m not in GPU_ONLY]
        threads = config.threads or default_threads()
        n = config.passes
        self.policy = Policy(warmup=1, min_reps=max(3, 2 * n), min_time_s=config.min_time,
                             max_reps=50, max_time_s=max(3.0, 4 * config.min_time)).share(n)
        bufs = self._copy_buffers(cuda)  # bufs[0]: also the read loop's buffer
        copies: dict[str, list[Timing]] = {}
        derived: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []
        for group in _groups(points, cuda):
            work = [Workload(p, config.keep, threads, cuda) for p in group]
            copied, *got = each_pass(
                [functools.partial(self._copies, bufs, threads)]
                + [functools.partial(self._point, w, timed, bufs[0]) for w in work], n)
            for t in copied:
                for how, timing in t.items():
                    copies.setdefault(how, []).append(timing)
            for w, passes in zip(work, got, strict=True):
                params = {**w.p.params(), "keep": config.keep, "threads": threads,
                          "device": w.device}
                res: dict[str, Any] = {}  # mode -> (seconds, GB/s); bar samples
                for mode in chosen:
                    if mode in timed:
                        joined = {part: Timing.join([t[mode, part] for t in passes])
                                  for m, part in passes[0] if m == mode}
                        yield from self._records(w, mode, {**params, "mode": mode}, joined, res)
                    else:
                        yield not_measured("probe", self.name, "time", "waived",
                                           "no CUDA GPU on this machine", {**params, "mode": mode})
                derived.append((w.p, params, res))
            del work
        if not cuda:
            yield not_measured("probe", self.name, "device_copy_gbps", "waived",
                               "no CUDA GPU on this machine")
        host_bw, dev_bw = yield from self._copy_records(copies, threads)
        for p, params, res in derived:
            yield from self._bars(p, params, res, host_bw, dev_bw)

    def _time(self, fn: Callable[[], object], device: str) -> Timing:
        """fn's seconds a call: host wall time, or on CUDA device time of GPU_CALLS calls
        between two events behind a wait that covers their launches."""
        if device == "cuda":
            return time_cuda(fn, self.policy, calls=GPU_CALLS, cover=True)
        return time_host(fn, self.policy)

    @staticmethod
    def _copy_buffers(cuda: bool) -> tuple[Any, ...]:
        """(host source, host destination[, device source, device destination])."""
        import torch

        src = torch.ones(COPY_BYTES, dtype=torch.uint8)
        if not cuda:
            return src, torch.empty_like(src)
        dev = torch.ones(DEVICE_COPY_BYTES, dtype=torch.uint8, device="cuda")
        return src, torch.empty_like(src), dev, torch.empty_like(dev)

    def _copies(self, bufs: tuple[Any, ...], threads: int) -> dict[str, Timing]:
        """One pass of the copies the bars divide by: host copy by native memcpy on
        `threads` threads and by torch's copy_ (the stronger is the CPU bars' reference);
        device-to-device with CUDA."""
        from kvbench.native import lib

        so, (src, dst) = lib(), bufs[:2]
        out = {"native memcpy threads": time_native(lambda: so.kvb_memcpy_threads(
                   dst.data_ptr(), src.data_ptr(), COPY_BYTES, 1, threads) * 1e-9, self.policy),
               "torch copy_": time_host(lambda: dst.copy_(src), self.policy)}
        if len(bufs) == 4:
            out["device"] = time_cuda(lambda: bufs[3].copy_(bufs[2]), self.policy)
        return out

    def _copy_records(self, copies: dict[str, list[Timing]], threads: int
                      ) -> Iterator[Record]:
        """The copies' records over all passes; returns (best host GB/s, device GB/s).
        A host copy counts its bytes once (memcpy's convention, as the bandwidth probe); the
        device copy counts them read plus written, the device memory traffic the roofline's
        memory_gbps counts and GPU decode's KV reads are held against."""
        host, dev = 0.0, None
        for how, passes in copies.items():
            t = Timing.join(passes)
            if how == "device":
                rec = measured("probe", self.name, "device_copy_gbps", "GB/s", "higher",
                               [gbps(2 * DEVICE_COPY_BYTES, s) for s in t.seconds],
                               {"bytes": DEVICE_COPY_BYTES, "counted": "read+write"},
                               t.method())
                dev = rec.value
            else:
                rec = measured("probe", self.name, "host_copy_gbps", "GB/s", "higher",
                               [gbps(COPY_BYTES, s) for s in t.seconds],
                               {"how": how, "bytes": COPY_BYTES, "threads": threads}, t.method())
                host = max(host, rec.value or 0.0)
            yield rec
        return host, dev

    def _point(self, w, modes: list[str], buf: Any) -> dict[tuple[str, str], Timing]:
        """One pass of every mode at one point: {(mode, part): timing} (_measure)."""
        return {(mode, part): t for mode in modes
                for part, t in self._measure(w, mode, buf).items()}

    def _measure(self, w, mode: str, buf: Any) -> dict[str, Timing]:
        """One pass of `mode` at one point: {"total": the step, and its parts ("transfer",
        "gpu", "cpu", "merge"); for CPU dense decode "sdpa" and "read" as well}."""
        import torch

        dev = w.device
        if mode == "gpu":
            return {"total": self._time(w.gpu, dev)}
        if mode == "gpu-transfer":
            return {"transfer": self._time(w.transfer, dev), "gpu": self._time(w.gpu, dev),
                    "total": self._time(w.gpu_transfer, dev)}
        if mode == "cpu-dense":
            if w.p.query == 1:
                return self._dense_rounds(w, buf)
            return {"total": time_host(w.cpu_dense, self.policy)}
        if mode == "cpu-sparse":
            return {"total": time_host(w.cpu_sparse, self.policy)}
        from kvbench.kernels import merge

        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        d_part, h_part = w.device_part(), w.cpu_sparse()
        return {"gpu": self._time(w.device_part, dev),
                "cpu": time_host(w.cpu_sparse, self.policy),
                "merge": self._time(lambda: merge(*d_part, *h_part), dev),
                "total": time_host(lambda: (w.hybrid(), sync()), self.policy)}

    def _records(self, w, mode: str, params: dict, parts: dict[str, Timing],
                 res: dict) -> Iterator[Record]:
        """The records of one mode at one point from its passes' joined timings; leaves its
        (timing, KV bytes read), and the decode bars' per-round ratios, in res."""
        p = w.p
        total = parts.pop("total")
        if mode in GPU_ONLY:
            nbytes = p.kv_bytes(w.total)
            parts.setdefault("gpu", total)
        elif mode == "cpu-dense":
            nbytes = p.kv_bytes(p.host_tokens)
            sdpa, read = parts.pop("sdpa", None), parts.pop("read", None)
            parts["cpu"] = total
            if sdpa is not None and read is not None:
                yield from self._read_ratios(w, params, total, sdpa, read, res)
        elif mode == "cpu-sparse":
            nbytes = p.kv_bytes(w.selected / (p.batch * p.kv_heads))
            parts["cpu"] = total
        else:
            nbytes = p.kv_bytes(p.gpu_tokens + w.selected / (p.batch * p.kv_heads))
            res["merge"] = parts["merge"]
        yield from_timing("probe", self.name, total, params)
        for part, t in parts.items():
            yield from_timing("probe", self.name, t, params, metric=f"time_{part}")
        rates = [gbps(nbytes, s) for s in total.seconds]
        yield measured("probe", self.name, "kv_read_gbps", "GB/s", "higher", rates,
                       {**params, "kv_bytes": int(nbytes)}, total.method())
        res[mode] = (total, nbytes)

    @staticmethod
    def _read_bytes(w) -> int:
        """Bytes the read loop reads: the KV's, up to COPY_BYTES (far past the LLC)."""
        return int(min(w.p.kv_bytes(w.p.host_tokens), COPY_BYTES))

    def _dense_rounds(self, w, buf: Any) -> dict[str, Timing]:
        """One pass of CPU dense decode, torch SDPA on the same tensors and a native
        read-only loop over as many bytes as the KV (K and V read once: decode's limit),
        timed in interleaved rounds so each round pairs the three under the same machine
        load. SDPA runs on as many torch threads as the kernel has."""
        import torch

        from kvbench.native import lib

        def clocked(fn: Callable[[], object]) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter_ns()
                fn()
                return (time.perf_counter_ns() - t0) * 1e-9
            return run

        so = lib()
        nbytes = self._read_bytes(w)
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(w.threads)  # SDPA on as many threads as the kernel
        try:
            dense, sdpa, read = time_rounds(
                [clocked(w.cpu_dense), clocked(w.sdpa),
                 lambda: so.kvb_read_threads(buf.data_ptr(), nbytes, 1, w.threads) * 1e-9],
                self.policy, timer="perf_counter_ns (attention), CLOCK_MONOTONIC (read loop)")
        finally:
            torch.set_num_threads(torch_threads)
        return {"total": dense, "sdpa": sdpa, "read": read}

    def _read_ratios(self, w, params: dict, dense: Timing, sdpa: Timing, read: Timing,
                     res: dict) -> Iterator[Record]:
        """The read loop's GB/s record; leaves the per-round ratios (SDPA time over dense
        time, dense GB/s over read GB/s) in res."""
        nbytes = self._read_bytes(w)
        yield measured("probe", self.name, "host_read_gbps", "GB/s", "higher",
                       [gbps(nbytes, s) for s in read.seconds],
                       {**params, "how": "native read loop", "bytes": nbytes}, read.method())
        res["sdpa"] = [s / d for s, d in zip(sdpa.seconds, dense.seconds, strict=True)]
        kv = w.p.kv_bytes(w.p.host_tokens)
        res["read"] = [gbps(kv, d) / gbps(nbytes, r)
                       for r, d in zip(read.seconds, dense.seconds, strict=True)]

    def _bars(self, p, params: dict, res: dict, host_bw: float,
              dev_bw: float | None) -> Iterator[Record]:
        from kvbench.kernels.cpu import isa as cpu_isa

        # metric, direction, samples, bar, extra method fields: a ratio of medians, per-pass
        # ratios of medians (quantities of one point) or per-round ratios of interleaved rounds
        bars: list[tuple[str, str, list[float], str, dict[str, str]]] = []
        medians = {"statistic": "ratio of medians"}
        per_pass = {"statistic": "median of per-pass ratios of medians"}
        rate = {m: gbps(res[m][1], res[m][0].median) for m in MODES if m in res}
        if p.query == 1 and "cpu-dense" in res and p.kv_bytes(p.host_tokens) >= BIG_KV:
            bars.append(("bar.cpu_dense_over_host_copy", "higher",
                         [rate["cpu-dense"] / host_bw], ">= 0.6", medians))
        if "sdpa" in res:  # per-round ratios of the dense decode rounds, in their passes
            paired: dict[str, Any] = {"statistic": "median of per-round ratios (interleaved "
                                                   "rounds)"}
            if len(res["cpu-dense"][0].blocks) > 1:
                paired["blocks"] = list(res["cpu-dense"][0].blocks)
            bars.append(("bar.sdpa_time_over_cpu_dense_time", "higher", res["sdpa"], ">= 1.0",
                         {**paired, "goal": ">= 1.5"}))
            bars.append(("bar.cpu_dense_over_host_read", "higher", res["read"], ">= 0.85",
                         {**paired, "isa": str(cpu_isa())}))
        if "cpu-sparse" in res and "cpu-dense" in res:
            (ts, ns), (td, nd) = res["cpu-sparse"], res["cpu-dense"]
            bars.append(("bar.cpu_sparse_over_dense_gbps", "higher",
                         [gbps(ns, s) / gbps(nd, d) for s, d in
                          zip(ts.pass_medians(), td.pass_medians(), strict=True)], ">= 0.5",
                         per_pass))
        if "hybrid" in res:
            bars.append(("bar.merge_share_of_hybrid", "lower",
                         [m / h for m, h in zip(res["merge"].pass_medians(),
                                                res["hybrid"][0].pass_medians(), strict=True)],
                         "<= 0.05", per_pass))
        if "gpu" in res and dev_bw and p.query == 1:  # KV read once / copy read+write
            bars.append(("bar.gpu_decode_over_device_copy", "higher",
                         [rate["gpu"] / dev_bw], ">= 0.8",
                         {**medians, "device_copy": "bytes read + written"}))
        for metric, direction, samples, bar, how in bars:
            rec = measured("probe", self.name, metric, "ratio", direction, samples, params, how)
            op, limit = bar.split()
            value = rec.value or 0.0
            ok = value >= float(limit) if op == ">=" else value <= float(limit)
            rec.method.update({"bar": bar, "pass": ok})
            yield rec

    @classmethod
    def plot(cls, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
        """Figs. 10 and 11 where data exist (kvbench.probes._attention_plots)."""
        from kvbench.probes._attention_plots import plot

        return plot([r for r in records if r.get("name") == cls.name], out_dir)
