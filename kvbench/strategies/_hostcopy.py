"""Host buffers that the accelerator copies to or from, and the one way to copy them.

GPU audit (issue 28) findings 3, 5 and 6. torch's caching host allocator
(`torch.empty(pin_memory=True)`, `Tensor.pin_memory()`) rounds a pinned block up to a power
of two and keeps it cached: one OPT-6.7B layer's k at batch 64 (1.07 GB) pins 2 GiB.
`HostKV.empty` gives host tensors of exactly their size, page-locked with cudaHostRegister
(kvbench.memory.HostBuffer, as the prefix cache's host tiers do) when the accelerator is
CUDA, and counts the bytes (`pinned`), which a strategy's `placement` reports as "pinned".
Only DMA sources and targets are allocated here; host KV that only the CPU reads (native
kernel, gathers) stays ordinary pageable memory.

`transfer(dst, src)` is every host <-> accelerator copy of the strategies: a non_blocking
copy on CUDA, so it requires both sides contiguous and the host side pinned. ATen copies a
non-contiguous or cross-dtype pair through `.contiguous()` temporaries, which are pageable
(Copy.cu, `copy_requires_temporaries`), and a pageable copy syncs the stream: no DMA, no
overlap. The checks run on every device, so CPU tests catch a strided transfer too.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def local_node() -> int:
    """The NUMA node of the first CPU this process may run on (0 without NUMA)."""
    from kvbench.topology import read_nodes

    cpu = min(os.sched_getaffinity(0))
    return next((n.id for n in read_nodes() if cpu in n.cpus), 0)


class HostKV:
    """Exact-size host tensors for DMA, pinned (cudaHostRegister) when `pin`.

    `pinned` counts their bytes whether or not `pin` (what would be page-locked on CUDA);
    `buffers` holds the HostBuffers, closed (unregistered, freed) with this object."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.pinned = 0
        self.buffers: list[Any] = []
        weakref.finalize(self, _close, self.buffers)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of `shape`: prod(shape) * itemsize bytes exactly."""
        import torch

        n = math.prod(shape) * dtype.itemsize
        self.pinned += n
        if not self.pin:
            return torch.empty(shape, dtype=dtype)
        from kvbench.memory import HostBuffer

        buf = HostBuffer(local_node(), max(n, 1))
        self.buffers.append(buf)
        buf.register_cuda()
        return buf.tensor()[:n].view(dtype).view(shape)


def _close(buffers: list[Any]) -> None:
    for buf in buffers:
        buf.close()
    buffers.clear()


def transfer(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src) between host and accelerator, non_blocking when either is on CUDA.

    Both must be contiguous and of one dtype, and on CUDA the host side pinned (see the
    module docstring); an AssertionError names what is not."""
    cuda = dst.is_cuda or src.is_cuda
    assert dst.dtype == src.dtype, f"transfer {src.dtype} -> {dst.dtype}: convert first"
    assert src.is_contiguous() and dst.is_contiguous(), (
        f"transfer of a strided tensor (src {tuple(src.stride())}, dst "
        f"{tuple(dst.stride())}): ATen would stage it in pageable memory")
    if cuda and not (dst.is_cuda and src.is_cuda):
        host = dst if src.is_cuda else src
        assert host.is_pinned(), "transfer from/to pageable host memory: pin it (HostKV)"
    return dst.copy_(src, non_blocking=cuda)


def to_host(host: torch.device, *xs: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Small per-step tensors (a query, block ids) sent to the host without blocking, and
    the CUDA event recorded after their copies on the current stream (None off CUDA): the
    launching thread queues the next kernels at once, whoever reads the copies waits on the
    event first (GPU audit finding 14). On CUDA a non_blocking copy to the host lands in
    pinned memory that torch allocates; off CUDA the tensors come back as they are."""
    import torch

    out = tuple(x.to(host, non_blocking=True) for x in xs)
    if not any(x.is_cuda for x in xs):
        return out, None
    landed = torch.cuda.Event()
    landed.record(torch.cuda.current_stream())
    return out, landed


def tokens_first(x: torch.Tensor) -> torch.Tensor:
    """k/v [B, Hkv, T, D] as a contiguous [T, B, Hkv, D] (a copy on x's device)."""
    return x.permute(2, 0, 1, 3).contiguous()


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """A token-major [n, B, Hkv, D] buffer as the view [B, Hkv, n, D] attention reads."""
    return x.permute(1, 2, 0, 3)
