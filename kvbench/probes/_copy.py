"""Copy execution shared by the bandwidth and latency probes (issue 3, CXL paper Fig. 1a).

A `Pair` is a source and destination endpoint; `open_copier` gives the object that copies
between them with NUMA-placed host buffers (`kvbench.memory.HostBuffer`): host-to-host in
native pinned threads (probes/copy.c, `HostCopier`), anything touching a GPU through torch
CUDA (`kvbench.probes._gpu_copy.GpuCopier`) or, as a raw-CUDA reference, cudaMemcpyAsync
through cupy (`kvbench.probes._cupy.CupyCopier`). Every copy advances through a span of at least
twice the LLC, so small copies read memory rather than a cache line the previous copy left
behind. A host memcpy call (one per thread and copy) of at least glibc's
x86_non_temporal_threshold (`nt_threshold`, 192M on the 2-core CI VM) writes with
non-temporal stores, which skip the destination's read-for-ownership: up to 3/2 the DRAM
rate of regular stores, the step from 64M to 256M there (`HostCopier.stores`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.memory import Endpoint, HostBuffer, endpoints, gpu_count, llc_bytes, runner_cpus
from kvbench.probes._cupy import CupyCopier
from kvbench.probes._gpu_copy import GpuCopier
from kvbench.schema import ParamValue, Record, not_measured
from kvbench.timing import PASSES, Policy, Timing, time_native, time_rounds
from kvbench.units import parse_sizes

MEMORY_KINDS = ("pageable", "pinned")
SAMPLE_S = 2e-3  # native samples repeat a copy until they last about this long
NO_GPU = "no CUDA GPU on this machine"
_SIDE = {"host": "h", "gpu": "d"}  # Pair.direction's letters: h2d, d2h, d2d, h2h


@dataclass(frozen=True)
class Pair:
    """Copy from src to dst; `direction` is h2h, h2d, d2h or d2d."""

    src: Endpoint
    dst: Endpoint

    @property
    def direction(self) -> str:
        return f"{_SIDE[self.src.kind]}2{_SIDE[self.dst.kind]}"

    def label(self) -> str:
        return f"{self.src}->{self.dst}"


def memory_kinds(memory: str, cuda: bool) -> tuple[list[str], list[str]]:
    """(kinds to measure, kinds to waive) for --memory pageable|pinned|both."""
    if memory not in ("pageable", "pinned", "both"):
        raise KvbenchError(f"unknown memory kind '{memory}' (pageable, pinned or both)")
    wanted = list(MEMORY_KINDS) if memory == "both" else [memory]
    if cuda:
        return wanted, []
    if memory == "pinned":
        raise KvbenchError(f"--pinned needs CUDA (cudaHostRegister): {NO_GPU}")
    return [k for k in wanted if k != "pinned"], [k for k in wanted if k == "pinned"]


def plan_pairs(src: str | None, dst: str | None, root: Path | str = "/"
               ) -> tuple[list[Pair], list[tuple[str, str]]]:
    """(pairs to measure, (src, dst) labels of default-matrix device pairs waived here)."""
    gpus = gpu_count()
    srcs, dsts = endpoints(src, root, gpus), endpoints(dst, root, gpus)
    pairs = [Pair(s, d) for s in srcs for d in dsts]
    waived: list[tuple[str, str]] = []
    if gpus == 0:  # every endpoint is a host node here (a gpu one would have raised)
        if dst is None:
            waived += [(str(e), "gpu:*") for e in srcs]
        if src is None:
            waived += [("gpu:*", str(e)) for e in dsts]
        if src is None and dst is None:
            waived.append(("gpu:*", "gpu:*"))
    return pairs, waived


@dataclass(frozen=True)
class Plan:
    pairs: list[Pair]
    waived_pairs: list[tuple[str, str]]
    kinds: list[str]
    waived_kinds: list[str]
    sizes: list[int]

    def kinds_of(self, pair: Pair) -> list[str]:
        return ["device"] if pair.direction == "d2d" else self.kinds

    @property
    def steps(self) -> int:
        return sum(len(self.kinds_of(p)) for p in self.pairs) * len(self.sizes)

    def waived(self, probe: str, metric: str, extra: dict[str, ParamValue]) -> Iterator[Record]:
        """`metric` records waived for the pairs and memory kinds this machine cannot run."""
        for s, d in self.waived_pairs:
            yield not_measured("probe", probe, metric, "waived", NO_GPU,
                               {"src": s, "dst": d, **extra})
        for pair in self.pairs:
            for kind in self.waived_kinds if pair.direction != "d2d" else []:
                yield not_measured("probe", probe, metric, "waived", "pinned memory needs CUDA "
                                   "(cudaHostRegister)", {"src": str(pair.src),
                                                          "dst": str(pair.dst), "memory": kind,
                                                          **extra})


def make_plan(src: str | None, dst: str | None, sizes: str, memory: str,
              root: Path | str = "/") -> Plan:
    """Check a sweep's options against this machine (one-line errors) and list what to
    measure: pairs x memory kinds x sizes, and what is waived here."""
    pairs, waived = plan_pairs(src, dst, root)
    kinds, waived_kinds = memory_kinds(memory, gpu_count() > 0)
    return Plan(pairs, waived, kinds, waived_kinds, sorted(set(parse_sizes(sizes))))


def copies_per_sample(sample: Callable[[int], float]) -> int:
    """Copies per sample so that one sample(iters) lasts about SAMPLE_S, from the fastest of
    three calibration samples (one that lost the CPU or met cold caches only runs slower)."""
    iters, per = 1, math.inf
    for _ in range(3):
        per = min(per, sample(iters))
        iters = max(1, min(1 << 22, math.ceil(SAMPLE_S / max(per, 1e-10))))
    return iters


def calibrated(sample: Callable[[int], float]) -> Callable[[Policy], Timing]:
    """measure(policy): time sample(iters) -> seconds per copy under policy, with iters
    chosen once, here, so that one sample lasts SAMPLE_S (a quantity timed in passes,
    kvbench.timing.time_passes, keeps one calibration)."""
    iters = copies_per_sample(sample)
    return lambda policy: time_native(lambda: sample(iters), policy)


@functools.lru_cache(maxsize=1)
def nt_threshold() -> int | None:
    """Bytes from which this process's glibc memcpy uses non-temporal stores, as its dynamic
    loader reports (same glibc, CPU and GLIBC_TUNABLES); None where unknown."""
    try:
        with open("/proc/self/maps") as maps:
            loader = next((ln.split()[-1] for ln in maps if "/ld-linux" in ln), None)
        out = subprocess.run([loader, "--list-tunables"], capture_output=True, text=True,
                             timeout=10, check=False).stdout if loader else ""
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"x86_non_temporal_threshold:\s*(0x[0-9a-fA-F]+|\d+)", out)
    return int(m.group(1), 0) if m else None


def coprime_hop(windows: int) -> int:
    """A step near windows / golden ratio that is coprime with windows (1 if windows < 3),
    so stepping by it visits every window once per cycle in a scattered order."""
    if windows < 3:
        return 1
    hop = max(2, int(windows * 0.6180339887))
    while math.gcd(hop, windows) != 1:
        hop += 1
    return hop


class HostCopier:
    """Host-to-host copies in native threads pinned to the CPU set of each source node (the
    nearest node with CPUs for a memory-only node); `bidirectional` copies both ways at once.
    Each thread may run on any CPU of its node rather than one CPU of its own: with as many
    threads as CPUs, a one-CPU pin keeps a thread behind whatever else runs on its CPU while
    a sibling's CPU idles, and a sample lasts as long as its slowest thread (issue 11: at
    --threads 2 on the 2-core VM the probe fell to 0.81-0.89x of a plain unpinned loop)."""

    def __init__(self, pair: Pair, kind: str, span: int, threads: int, bidirectional: bool,
                 root: Path | str = "/") -> None:
        from kvbench.native import lib

        self.so = lib()
        self.span, self.threads = span, threads
        a, b = pair.src.index, pair.dst.index
        routes = [(a, b)] + ([(b, a)] if bidirectional else [])
        self.buffers: list[HostBuffer] = []
        self.routes: list[tuple[HostBuffer, HostBuffer, tuple[int, ...]]] = []
        try:
            for s, d in routes:
                sb, db = HostBuffer(s, span), HostBuffer(d, span)
                self.buffers += [sb, db]
                if kind == "pinned":
                    sb.register_cuda()
                    db.register_cuda()
                self.routes.append((sb, db, runner_cpus(s, root)))
        except BaseException:
            self.close()
            raise
        self.cpus = sorted({c for _, _, cpus in self.routes for c in cpus})
        self._cpu_sets: list[Any] = []
        self.cpus_per_thread = 0  # CPUs each copy thread could run on (after a sample)

    @property
    def placement(self) -> str:
        bad = [f"node {b.node}: {b.placement}" for b in self.buffers if b.placement != "verified"]
        return "; ".join(bad) or "verified"

    def _jobs(self, size: int, latency: bool) -> Any:
        from kvbench.native import CopyJob

        stride = (size + 63) // 64 * 64 if latency else size
        windows = (self.span - size) // stride + 1
        hop = coprime_hop(windows) if latency else 1
        n = 1 if latency else max(1, min(self.threads, size // 64))
        chunk = (size // n) // 64 * 64
        jobs = []
        for sb, db, cpus in self.routes:
            node_cpus = (ctypes.c_int * len(cpus))(*cpus)
            self._cpu_sets.append(node_cpus)  # kept alive while jobs point at it
            for t in range(n):
                off = t * chunk
                length = size - off if t == n - 1 else chunk
                jobs.append(CopyJob(db.ptr + off, sb.ptr + off, length, stride, windows, hop, 0,
                                    node_cpus, len(cpus), int(latency), 0))
        return (CopyJob * len(jobs))(*jobs), len(jobs)

    def bytes_per_copy(self, size: int) -> int:
        return size * len(self.routes)

    def stores(self, size: int) -> str:
        """'regular' or 'non-temporal' (or both, '/'-joined): how glibc's memcpy writes each
        thread's chunk of a size-byte copy; 'unknown' where nt_threshold() is."""
        limit = nt_threshold()
        if limit is None:
            return "unknown"
        jobs, njobs = self._jobs(size, False)
        return "/".join(sorted({"non-temporal" if jobs[k].chunk >= limit else "regular"
                                for k in range(njobs)}))

    def sweep(self, sizes: Sequence[int], policy: Policy) -> dict[int, tuple[Timing, int]]:
        """size -> (seconds per copy, copies per sample), every size sampled in interleaved
        rounds (time_rounds, in PASSES slices of the sweep: the timings' blocks), each
        sample aggregating copies to last about SAMPLE_S."""
        samplers = [self.sampler(s) for s in sizes]
        iters = [copies_per_sample(f) for f in samplers]
        timings = time_rounds([functools.partial(f, n) for f, n in zip(samplers, iters,
                                                                         strict=True)], policy,
                              slices=PASSES)
        return {s: (t, n) for s, t, n in zip(sizes, timings, iters, strict=True)}

    def measure(self, size: int, latency: bool = False) -> Callable[[Policy], Timing]:
        """measure(policy): seconds per copy of `size` bytes (per route, all routes at once).
        latency=True uses one thread, fences after every copy and visits line-aligned
        windows in a scattered order, so copies neither overlap nor find their lines cached:
        the cost of one isolated small copy rather than a streaming rate."""
        return calibrated(self.sampler(size, latency))

    def sampler(self, size: int, latency: bool = False) -> Callable[[int], float]:
        """sample(iters) -> seconds per copy, measured natively over iters copies."""
        jobs, njobs = self._jobs(size, latency)

        def sample(iters: int) -> float:
            ns = self.so.kvb_copy_jobs(jobs, njobs, iters)
            if ns == 0:
                raise KvbenchError("native copy threads could not be created")
            self.cpus_per_thread = min(jobs[k].allowed for k in range(njobs))
            return ns * 1e-9 / iters

        return sample

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers = []


def open_copier(pair: Pair, kind: str, max_size: int, threads: int, bidirectional: bool,
                root: Path | str = "/", engine: str = "torch"
                ) -> HostCopier | GpuCopier | CupyCopier:
    """The copier for pair with buffers of max(max_size, 2 x LLC) bytes per endpoint; a
    pair touching a GPU copies through `engine`: torch (GpuCopier) or cupy (CupyCopier,
    cudaMemcpyAsync)."""
    span = max(max_size, 2 * llc_bytes(root))
    if pair.direction == "h2h":
        return HostCopier(pair, kind, span, threads, bidirectional, root)
    if engine == "cupy":
        return CupyCopier(pair, kind, span, bidirectional)
    return GpuCopier(pair, kind, span, bidirectional)


def host_memcpy_ref(so: ctypes.CDLL, dst: int, src: int, size: int, threads: int) -> float:
    """Seconds for one plain C memcpy of size bytes: kvb_memcpy_loop for one thread,
    kvb_memcpy_threads (unpinned, slices) for more."""
    ns = (so.kvb_memcpy_loop(dst, src, size, 1) if threads == 1
          else so.kvb_memcpy_threads(dst, src, size, 1, threads))
    return ns * 1e-9
