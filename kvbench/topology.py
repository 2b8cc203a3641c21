"""NUMA topology from sysfs, read under a root path so tests can use a fake tree.

A node with memory and no CPUs is flagged memory-only: that is how a CXL Type-3 memory
expander appears to Linux (CXL KV-storage paper, section 3.1). Devices under
/sys/bus/cxl/devices are listed when the kernel exposes them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError

NODE_DIR = "sys/devices/system/node"


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    mem_total_bytes: int
    distances: tuple[int, ...]

    @property
    def memory_only(self) -> bool:
        return self.mem_total_bytes > 0 and not self.cpus

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory_only"] = self.memory_only
        return d


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); empty text -> ()."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def read_file(path: Path, default: str = "") -> str:
    """A sysfs/procfs file's text, or default when it cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return default


def meminfo_total(text: str) -> int:
    m = re.search(r"MemTotal:\s+(\d+)\s*kB", text)
    return int(m.group(1)) * 1024 if m else 0


def read_nodes(root: Path | str = "/") -> list[NumaNode]:
    """Every NUMA node under root; a kernel without NUMA gives one node 0 with all CPUs."""
    root = Path(root)
    base = root / NODE_DIR
    dirs = sorted((p for p in base.glob("node[0-9]*") if p.is_dir()),
                  key=lambda p: int(p.name[4:])) if base.is_dir() else []
    if not dirs:
        cpus = parse_cpulist(read_file(root / "sys/devices/system/cpu/online")) or tuple(
            range(os.cpu_count() or 1))
        return [NumaNode(0, cpus, meminfo_total(read_file(root / "proc/meminfo")), (10,))]
    nodes = []
    for d in dirs:
        dist = tuple(int(x) for x in read_file(d / "distance").split())
        nodes.append(NumaNode(int(d.name[4:]), parse_cpulist(read_file(d / "cpulist")),
                              meminfo_total(read_file(d / "meminfo")), dist))
    return nodes


def get_node(node_id: int, root: Path | str = "/") -> NumaNode:
    """The node with this id, or a one-line error naming the nodes that exist."""
    nodes = read_nodes(root)
    for n in nodes:
        if n.id == node_id:
            return n
    ids = ", ".join(str(n.id) for n in nodes)
    raise KvbenchError(f"NUMA node {node_id} does not exist on this machine (nodes: {ids})")


def read_cxl_devices(root: Path | str = "/") -> list[dict[str, Any]]:
    """Devices under /sys/bus/cxl/devices with their NUMA node and sizes where exposed."""
    base = Path(root) / "sys/bus/cxl/devices"
    if not base.is_dir():
        return []
    out = []
    for d in sorted(base.iterdir()):
        dev: dict[str, Any] = {"name": d.name}
        numa = read_file(d / "numa_node").strip()
        if numa:
            dev["numa_node"] = int(numa)
        for attr in ("ram/size", "pmem/size", "size"):
            val = read_file(d / attr).strip()
            if val:
                dev[attr.replace("/", "_")] = int(val, 0)
        out.append(dev)
    return out


@lru_cache(maxsize=1)
def libnuma() -> ctypes.CDLL | None:
    """libnuma.so.1 when present and the kernel supports NUMA, else None."""
    name = ctypes.util.find_library("numa") or "libnuma.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.numa_available.restype = ctypes.c_int
    return lib if lib.numa_available() >= 0 else None
