"""Copies that touch a GPU, for the bandwidth and latency probes (issue 3, CXL paper
section 3.1 / Fig. 1a: host-to-device, device-to-host and device-to-device copies).

`GpuCopier` copies through torch CUDA between device tensors and NUMA-placed host buffers
(`kvbench.memory.HostBuffer`, registered with cudaHostRegister when pinned); host-to-host
copies are `kvbench.probes._copy.HostCopier`, and `open_copier` there picks between them.
torch is imported on construction only, so `kvbench list` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvbench.memory import Endpoint, HostBuffer
from kvbench.timing import Policy, Timing, time_cuda, time_host
from kvbench.units import gbps

if TYPE_CHECKING:
    from kvbench.probes._copy import Pair

_SLEEP_CYCLES = 200_000  # device-side wait queued before each timed copy (~100 us)


class DeviceCopier:
    """What every GPU copy engine shares: host buffers (`buffers`) and routes (`routes`,
    one (src, dst) per direction), measured by its own `timing(size, policy, latency)`."""

    buffers: list[HostBuffer]
    routes: list[tuple[Any, ...]]

    def timing(self, size: int, policy: Policy, latency: bool = False) -> Timing:
        raise NotImplementedError

    @property
    def placement(self) -> str:
        bad = [f"node {b.node}: {b.placement}" for b in self.buffers if b.placement != "verified"]
        return "; ".join(bad) or ("verified" if self.buffers else "device memory")

    def bytes_per_copy(self, size: int) -> int:
        return size * len(self.routes)

    def measure(self, size: int, latency: bool = False) -> Callable[[Policy], Timing]:
        """measure(policy) = timing(size, policy, latency), as HostCopier.measure."""
        return lambda policy: self.timing(size, policy, latency)

    def sweep(self, sizes: Sequence[int], policy: Policy) -> dict[int, tuple[Timing, int]]:
        """size -> (seconds per copy, 1 copy per sample), one size after another."""
        return {s: (self.timing(s, policy), 1) for s in sizes}


class GpuCopier(DeviceCopier):
    """Copies that touch a GPU, through torch CUDA with host buffers placed on their node
    (registered with cudaHostRegister when pinned). Bandwidth timings use CUDA events with
    a device-side wait queued first; latency timings are host wall time to completion."""

    def __init__(self, pair: Pair, kind: str, span: int, bidirectional: bool) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", (pair.dst if pair.dst.kind == "gpu" else pair.src).index)
        self.buffers: list[HostBuffer] = []
        self.routes: list[tuple[Any, Any]] = []
        try:
            ends = [(pair.src, pair.dst)] + ([(pair.dst, pair.src)] if bidirectional else [])
            for s, d in ends:
                self.routes.append((self._alloc(s, kind, span), self._alloc(d, kind, span)))
        except BaseException:
            self.close()
            raise
        self.span = span
        self.streams = [torch.cuda.Stream(self.device) for _ in self.routes]
        self._step = 0

    def _alloc(self, ep: Endpoint, kind: str, span: int) -> Any:
        if ep.kind == "gpu":
            return self.torch.empty(span, dtype=self.torch.uint8, device=f"cuda:{ep.index}")
        buf = HostBuffer(ep.index, span)
        self.buffers.append(buf)
        if kind == "pinned":
            buf.register_cuda()
        return buf.tensor()

    def _copy(self, size: int) -> None:
        """One copy of size bytes per route, routes concurrent on their own streams."""
        torch = self.torch
        windows = max(1, self.span // size)
        off = (self._step % windows) * size
        self._step += 1
        cur = torch.cuda.current_stream(self.device)
        for (src, dst), stream in zip(self.routes, self.streams, strict=True):
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                dst[off:off + size].copy_(src[off:off + size], non_blocking=True)
        for stream in self.streams:
            cur.wait_stream(stream)

    def timing(self, size: int, policy: Policy, latency: bool = False) -> Timing:
        torch = self.torch
        with torch.cuda.device(self.device):
            if latency:
                def once() -> None:
                    self._copy(size)
                    torch.cuda.current_stream(self.device).synchronize()

                return time_host(once, policy)
            return time_cuda(lambda: self._copy(size), policy,
                             before=lambda: torch.cuda._sleep(_SLEEP_CYCLES))

    def torch_loop_gbps(self, size: int, reps: int = 10, rounds: int = 5) -> list[float]:
        """GB/s of a bare back-to-back torch copy loop on the same buffers (the reference
        for the pinned bar), one value per round of `reps` copies."""
        torch = self.torch
        src, dst = self.routes[0]
        out = []
        with torch.cuda.device(self.device):
            for _ in range(rounds + 1):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(reps):
                    dst[:size].copy_(src[:size], non_blocking=True)
                e1.record()
                e1.synchronize()
                out.append(gbps(size * reps, e0.elapsed_time(e1) * 1e-3))
        return out[1:]  # the first round is the warm-up

    def close(self) -> None:
        self.routes = []
        for b in self.buffers:
            b.close()
        self.buffers = []
