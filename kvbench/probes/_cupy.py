"""The raw-CUDA reference for GPU copies (GPU campaign item 3): `kvbench probe bandwidth
--engine cupy` copies with cudaMemcpyAsync through cupy's runtime bindings
(cupy.cuda.runtime), as glibc memcpy is the reference for host copies.

Same buffers as the torch engine (kvbench.probes._gpu_copy.GpuCopier): NUMA-placed host
buffers (`kvbench.memory.HostBuffer`), page-locked with cudaHostRegister when pinned; device
memory from cudaMalloc (not torch's caching allocator). Its own CUDA events bracket each
sample, recorded on torch's current stream behind the same device-side wait
(torch.cuda._sleep) so that the host's launch time stays out of small copies: the timing
is time_cuda(before=wait)'s, with the copies, events and streams all raw runtime calls.
Bidirectional copies run route 0 on that stream and the reverse route on a stream of its
own, forked from and joined into it by events.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvbench.errors import KvbenchError
from kvbench.memory import Endpoint, HostBuffer
from kvbench.probes._gpu_copy import _SLEEP_CYCLES, DeviceCopier
from kvbench.timing import Policy, Timing, time_host

if TYPE_CHECKING:
    from kvbench.probes._copy import Pair

TIMER = "cuda_event (cudaEventElapsedTime through cupy.cuda.runtime)"


def cupy_runtime() -> Any:
    """cupy.cuda.runtime, or a one-line error where cupy is not installed."""
    try:
        import cupy
    except ImportError:
        raise KvbenchError("--engine cupy needs cupy (pip install cupy-cuda12x), which is not "
                           "installed here") from None
    return cupy.cuda.runtime


class CupyCopier(DeviceCopier):
    """Copies that touch a GPU by cudaMemcpyAsync (GpuCopier's interface and buffers)."""

    def __init__(self, pair: Pair, kind: str, span: int, bidirectional: bool) -> None:
        import torch

        self.torch = torch
        self.rt = rt = cupy_runtime()
        self.index = (pair.dst if pair.dst.kind == "gpu" else pair.src).index
        self.span = span
        self.buffers: list[HostBuffer] = []
        self.registered: list[int] = []  # host pointers page-locked here
        self.device_ptrs: list[int] = []
        self.routes: list[tuple[int, int, int]] = []  # (src, dst, cudaMemcpyKind)
        self.streams: list[int] = []  # one per route after the first
        self.events: list[int] = []
        self._step = 0
        try:
            with torch.cuda.device(self.index):
                ends = [(pair.src, pair.dst)] + ([(pair.dst, pair.src)] if bidirectional else [])
                kinds = {("host", "gpu"): rt.memcpyHostToDevice,
                         ("gpu", "host"): rt.memcpyDeviceToHost,
                         ("gpu", "gpu"): rt.memcpyDeviceToDevice}
                for s, d in ends:
                    self.routes.append((self._alloc(s, kind), self._alloc(d, kind),
                                        kinds[(s.kind, d.kind)]))
                self.streams = [rt.streamCreateWithFlags(rt.streamNonBlocking)
                                for _ in self.routes[1:]]
                self.events = [rt.eventCreate(), rt.eventCreate()] + [
                    rt.eventCreateWithFlags(rt.eventDisableTiming) for _ in self.routes]
        except BaseException:
            self.close()
            raise

    def _alloc(self, ep: Endpoint, kind: str) -> int:
        if ep.kind == "gpu":  # on its own GPU (a d2d pair's source may be another)
            with self.torch.cuda.device(ep.index):
                self.device_ptrs.append(self.rt.malloc(self.span))
            return self.device_ptrs[-1]
        buf = HostBuffer(ep.index, self.span)
        self.buffers.append(buf)
        if kind == "pinned":
            self.rt.hostRegister(buf.ptr, self.span, 0)
            self.registered.append(buf.ptr)
        return buf.ptr

    def _main(self) -> int:
        """torch's current stream on the copier's GPU, as a cudaStream_t."""
        return int(self.torch.cuda.current_stream(self.index).cuda_stream)

    def _copy(self, size: int, main: int) -> None:
        """One cudaMemcpyAsync of size bytes per route, at the next window of the buffers;
        routes after the first on their own streams, forked from and joined into `main`."""
        rt = self.rt
        off = (self._step % max(1, self.span // size)) * size
        self._step += 1
        fork, joins = self.events[2], self.events[3:]
        if self.streams:
            rt.eventRecord(fork, main)
            for s in self.streams:
                rt.streamWaitEvent(s, fork, 0)
        for (src, dst, kind), s in zip(self.routes, [main, *self.streams], strict=True):
            rt.memcpyAsync(dst + off, src + off, size, kind, s)
        for s, e in zip(self.streams, joins, strict=True):
            rt.eventRecord(e, s)
            rt.streamWaitEvent(main, e, 0)

    def timing(self, size: int, policy: Policy, latency: bool = False) -> Timing:
        """Seconds per copy: event pairs behind a device-side wait (bandwidth), or host wall
        time to completion (latency)."""
        rt, torch = self.rt, self.torch
        with torch.cuda.device(self.index):
            main = self._main()
            if latency:
                def once() -> None:
                    self._copy(size, main)
                    rt.streamSynchronize(main)

                return time_host(once, policy)
            for _ in range(policy.warmup):
                self._copy(size, main)
            rt.streamSynchronize(main)
            e0, e1 = self.events[:2]
            samples: list[float] = []
            start = time.perf_counter_ns()
            while not policy.done(len(samples), (time.perf_counter_ns() - start) * 1e-9):
                torch.cuda._sleep(_SLEEP_CYCLES)
                rt.eventRecord(e0, main)
                self._copy(size, main)
                rt.eventRecord(e1, main)
                rt.eventSynchronize(e1)
                samples.append(rt.eventElapsedTime(e0, e1) * 1e-3)
        return Timing(tuple(samples), TIMER, policy.warmup)


    def close(self) -> None:
        rt = self.rt
        for s in self.streams:
            rt.streamDestroy(s)
        for e in self.events:
            rt.eventDestroy(e)
        for p in self.registered:
            rt.hostUnregister(p)
        for p in self.device_ptrs:
            rt.free(p)
        for b in self.buffers:
            b.close()
        self.streams, self.events, self.registered, self.device_ptrs, self.buffers = \
            [], [], [], [], []
        self.routes = []
