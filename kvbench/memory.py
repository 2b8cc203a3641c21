"""Memory endpoints and NUMA-placed buffers shared by the memory probes (issue 3).

An endpoint is `host:N` (the memory of NUMA node N, memory-only CXL nodes included: the
CXL KV-storage paper, section 3.1, places its host buffers on such a node) or `gpu:K`.
Host buffers are allocated on their node through libnuma, touched, and their placement is
checked page by page with move_pages; every record says whether it was verified. The
topology root is a parameter so tests can validate endpoints against a fake sysfs.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvbench.errors import KvbenchError
from kvbench.topology import NumaNode, get_node, libnuma, read_nodes
from kvbench.units import parse_size

PAGE = mmap.PAGESIZE
_VERIFY_PAGES = 4096  # pages sampled evenly across a buffer for the placement check
_MADV_HUGEPAGE = 14


@dataclass(frozen=True, order=True)
class Endpoint:
    """A memory: kind 'host' (NUMA node `index`) or 'gpu' (CUDA device `index`)."""

    kind: Literal["host", "gpu"]
    index: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


def parse_endpoint(text: str) -> Endpoint:
    """'host:1' -> Endpoint('host', 1); anything else is a one-line error."""
    m = re.fullmatch(r"\s*(host|gpu):(\d+)\s*", text)
    if not m:
        raise KvbenchError(f"cannot parse endpoint '{text}' (expected host:N or gpu:K)")
    return Endpoint(m.group(1), int(m.group(2)))  # type: ignore[arg-type]


def gpu_count() -> int:
    """CUDA devices torch can see (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def host_nodes(root: Path | str = "/") -> list[NumaNode]:
    """NUMA nodes that have memory (CPU-less memory-only nodes included)."""
    return [n for n in read_nodes(root) if n.mem_total_bytes > 0]


def check_endpoint(ep: Endpoint, root: Path | str = "/", gpus: int | None = None) -> None:
    """Raise KvbenchError unless ep exists here (a node with memory, or a visible GPU)."""
    if ep.kind == "host":
        if get_node(ep.index, root).mem_total_bytes <= 0:
            raise KvbenchError(f"NUMA node {ep.index} has no memory: '{ep}' cannot be measured")
        return
    gpus = gpu_count() if gpus is None else gpus
    if gpus == 0:
        raise KvbenchError(f"no CUDA GPU on this machine: '{ep}' cannot be measured")
    if ep.index >= gpus:
        raise KvbenchError(f"GPU {ep.index} does not exist (this machine has {gpus})")


def endpoints(text: str | None, root: Path | str = "/", gpus: int | None = None
              ) -> list[Endpoint]:
    """Comma-separated endpoints, each checked; None means every host node and GPU."""
    gpus = gpu_count() if gpus is None else gpus
    if text is None:
        return ([Endpoint("host", n.id) for n in host_nodes(root)]
                + [Endpoint("gpu", k) for k in range(gpus)])
    eps = [parse_endpoint(t) for t in text.split(",") if t.strip()]
    if not eps:
        raise KvbenchError("empty endpoint list (expected host:N or gpu:K)")
    for ep in eps:
        check_endpoint(ep, root, gpus)
    return list(dict.fromkeys(eps))


def runner_node(node_id: int, root: Path | str = "/") -> NumaNode:
    """The node whose CPUs drive accesses to node_id's memory: itself, or for a memory-only
    (CXL) node the node with CPUs nearest to it by the sysfs distance table."""
    node = get_node(node_id, root)
    if node.cpus:
        return node
    nodes = read_nodes(root)
    with_cpus = [n for n in nodes if n.cpus]
    if not with_cpus:
        raise KvbenchError("no NUMA node has CPUs: cannot run memory probes")
    ids = [n.id for n in nodes]

    def dist(n: NumaNode) -> int:
        d = node.distances
        return d[ids.index(n.id)] if len(d) == len(ids) else 255

    return min(with_cpus, key=lambda n: (dist(n), n.id))


def runner_cpus(node_id: int, root: Path | str = "/") -> tuple[int, ...]:
    """CPUs of runner_node(node_id) that this process may run on; () if none (no pinning)."""
    allowed = os.sched_getaffinity(0)
    return tuple(c for c in runner_node(node_id, root).cpus if c in allowed)


def llc_bytes(root: Path | str = "/") -> int:
    """Size of cpu0's largest cache (the last-level cache); 32 MiB when sysfs has none."""
    best = 0
    for idx in (Path(root) / "sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            best = max(best, parse_size((idx / "size").read_text().strip()))
        except (OSError, KvbenchError):
            continue
    return best or 32 << 20


class HostBuffer:
    """`size` bytes on NUMA node `node`, touched; `placement` says whether verified.

    Memory comes from numa_alloc_onnode (libnuma), else from an anonymous mmap (then
    unplaced). `hugepages` asks for transparent huge pages before the first touch. Without
    them the mapping is one page longer than `size`: Linux 6.7+ starts an anonymous mapping
    whose length is a multiple of 2 MiB on a 2 MiB boundary, and on the 2-core CI VM
    (kernel 6.18) 2-thread copies between two such buffers ran 3-10% slower than between
    malloc'd ones (issue 11 item 3, results/memory-probes-cpu-2c), a layout that neither
    malloc nor torch's allocator gives the data a user copies.
    """

    def __init__(self, node: int, size: int, hugepages: bool = False) -> None:
        self.node, self.size = node, size
        self.mapped = size if hugepages else size + PAGE
        self.pinned = False
        self._numa = libnuma()
        self._mmap: mmap.mmap | None = None
        if self._numa is not None:
            self._numa.numa_alloc_onnode.restype = ctypes.c_void_p
            self._numa.numa_alloc_onnode.argtypes = [ctypes.c_size_t, ctypes.c_int]
            self._numa.numa_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            ptr = self._numa.numa_alloc_onnode(self.mapped, node)
            if not ptr:
                raise KvbenchError(f"cannot allocate {size} bytes on NUMA node {node}")
            self.ptr: int = ptr
        else:
            self._mmap = mmap.mmap(-1, self.mapped)
            self._view: ctypes.c_char | None = ctypes.c_char.from_buffer(self._mmap)
            self.ptr = ctypes.addressof(self._view)
        if hugepages:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(self.ptr), ctypes.c_size_t(size), _MADV_HUGEPAGE)
        ctypes.memset(self.ptr, 0x5A, size)  # touch every page so it is placed now
        self.placement = self._verify()

    def _verify(self) -> str:
        """'verified', or 'unverified (reason)' from a move_pages query of sampled pages."""
        if self._numa is None:
            return "unverified (libnuma unavailable: buffer not placed)"
        npages = (self.size + PAGE - 1) // PAGE
        count = min(npages, _VERIFY_PAGES)
        pages = (ctypes.c_void_p * count)(
            *[self.ptr + (i * npages // count) * PAGE for i in range(count)])
        status = (ctypes.c_int * count)()
        self._numa.numa_move_pages.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p,
                                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        rc = self._numa.numa_move_pages(0, count, pages, None, status, 0)
        if rc != 0:
            return f"unverified (move_pages query returned {rc})"
        wrong = [s for s in status if s != self.node]
        if wrong:
            return (f"unverified ({len(wrong)} of {count} sampled pages not on node "
                    f"{self.node}, e.g. {wrong[0]})")
        return "verified"

    def register_cuda(self) -> None:
        """Page-lock the buffer with cudaHostRegister so device copies are pinned DMA."""
        import torch

        err = torch.cuda.cudart().cudaHostRegister(self.ptr, self.size, 0)
        if int(err) != 0:
            raise KvbenchError(f"cudaHostRegister of {self.size} bytes on node {self.node} "
                               f"failed (error {int(err)})")
        self.pinned = True

    def tensor(self) -> Any:
        """The buffer as a torch uint8 tensor of shape (size,), sharing its memory."""
        import torch

        return torch.frombuffer((ctypes.c_uint8 * self.size).from_address(self.ptr),
                                dtype=torch.uint8)

    def close(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.pinned = False
        if self._numa is not None and self.ptr:
            self._numa.numa_free(self.ptr, self.mapped)
        elif self._mmap is not None:
            self._view = None  # release the exported pointer before unmapping
            self._mmap.close()
        self.ptr = 0

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
