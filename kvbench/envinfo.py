"""The environment record stored once per result file: CPU, NUMA, GPUs, versions.

Everything is read from sysfs/procfs under a root path (tests use a fake tree), NVML
through pynvml when installed, and torch when importable; each missing piece becomes a
note in the record rather than an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench import __version__
from kvbench.store import git_state
from kvbench.topology import libnuma, meminfo_total, read_cxl_devices, read_file, read_nodes

# Per-lane usable GB/s after line coding (PCIe gen -> GB/s per lane, decimal).
_PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def pcie_link_gbps(gen: int, width: int) -> float:
    """Unidirectional PCIe payload rate before protocol overhead, decimal GB/s."""
    return _PCIE_LANE_GBPS.get(gen, 0.0) * width


def cpu_info(root: Path) -> dict[str, Any]:
    cpuinfo = read_file(root / "proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    logical = len(re.findall(r"^processor\s*:", cpuinfo, re.M)) or os.cpu_count() or 1
    cores = {(m.group(1), m.group(2)) for m in re.finditer(
        r"^physical id\s*:\s*(\d+).*?^core id\s*:\s*(\d+)", cpuinfo, re.M | re.S)}
    caches = []
    for idx in sorted((root / "sys/devices/system/cpu/cpu0/cache").glob("index*")):
        caches.append({"level": int(read_file(idx / "level").strip() or 0),
                       "type": read_file(idx / "type").strip(),
                       "size": read_file(idx / "size").strip(),
                       "shared_cpus": read_file(idx / "shared_cpu_list").strip()})
    governor = read_file(root / "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").strip()
    return {"model": model.group(1).strip() if model else platform.processor() or "unknown",
            "arch": platform.machine(), "logical_cpus": logical,
            "physical_cores": len(cores) or None, "affinity_cpus": len(os.sched_getaffinity(0)),
            "caches": caches, "governor": governor or None}


def gpu_info(root: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """GPUs through NVML (preferred) or torch; notes say what could not be read."""
    notes: list[str] = []
    try:
        import pynvml
    except ImportError:
        pynvml = None
        notes.append("pynvml not installed: GPU link and driver details unavailable")
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, driver not loaded, ...
            notes.append(f"NVML unavailable: {e}")
        else:
            try:
                listed = _nvml_gpus(pynvml, root, notes)
            finally:
                pynvml.nvmlShutdown()
            if listed is not None:
                return listed, notes
    gpus = []
    try:
        import torch

        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_bytes": p.total_memory})
    except ImportError:
        pass
    return gpus, notes


def _nvml_gpus(nv: Any, root: Path, notes: list[str]) -> list[dict[str, Any]] | None:
    """Every GPU NVML lists (None when it cannot count them). Each query is asked on its
    own: one NVML refuses (NVMLError_NotSupported for the PCIe link under vGPU, confidential
    computing or gVisor's nvproxy, ...) leaves its field None and a note, not the record."""

    def ask(what: str, query: Callable[..., Any], *args: Any) -> Any:
        try:
            return query(*args)
        except Exception as e:  # pynvml.NVMLError and its NotSupported, ... subclasses
            notes.append(f"NVML {what}: {type(e).__name__}: {e} (recorded as None)")
            return None

    count = ask("device count", nv.nvmlDeviceGetCount)
    if count is None:
        return None
    driver = ask("driver version", nv.nvmlSystemGetDriverVersion)
    gpus = []
    for i in range(count):
        h = ask(f"GPU {i} handle", nv.nvmlDeviceGetHandleByIndex, i)
        got = {} if h is None else {
            key: ask(f"GPU {i} {key}", query, h) for key, query in (
                ("name", nv.nvmlDeviceGetName), ("memory", nv.nvmlDeviceGetMemoryInfo),
                ("pci", nv.nvmlDeviceGetPciInfo),
                ("pcie_gen", nv.nvmlDeviceGetCurrPcieLinkGeneration),
                ("pcie_width", nv.nvmlDeviceGetCurrPcieLinkWidth),
                ("pcie_gen_max", nv.nvmlDeviceGetMaxPcieLinkGeneration),
                ("pcie_width_max", nv.nvmlDeviceGetMaxPcieLinkWidth))}
        name, memory, pci = got.get("name"), got.get("memory"), got.get("pci")
        bus = None if pci is None else pci.busId
        bus = bus.decode() if isinstance(bus, bytes) else bus
        # NVML writes an 8-digit PCI domain, sysfs a 4-digit one
        numa = "" if bus is None else read_file(
            root / "sys/bus/pci/devices" / bus.lower()[-12:] / "numa_node").strip()
        mgen, mwidth = got.get("pcie_gen_max"), got.get("pcie_width_max")
        gpus.append({
            "index": i, "name": name.decode() if isinstance(name, bytes) else name,
            "memory_bytes": None if memory is None else int(memory.total), "pci_bus_id": bus,
            "pcie_gen": got.get("pcie_gen"), "pcie_width": got.get("pcie_width"),
            "pcie_gen_max": mgen, "pcie_width_max": mwidth,
            "pcie_link_gbps_max": None if mgen is None or mwidth is None
            else pcie_link_gbps(mgen, mwidth),
            "numa_node": int(numa) if numa and int(numa) >= 0 else None, "driver": driver,
        })
    return gpus


def versions() -> dict[str, Any]:
    v: dict[str, Any] = {"python": platform.python_version(), "kernel": platform.release(),
                         "kvbench": __version__}
    import numpy

    v["numpy"] = numpy.__version__
    try:
        import torch

        v["torch"] = torch.__version__
        v["cuda"] = torch.version.cuda
        v["torch_threads"] = torch.get_num_threads()
    except ImportError:
        v["torch"] = None
    return v


# What identifies a machine and its software for comparisons: never the host name, the
# time, or state that can change while it runs. A VM's MemTotal (memory_bytes, each node's
# mem_total_bytes) moves when a balloon or virtio-mem device resizes it: on the CI VM node 0
# grew by one 128 MiB virtio-mem block between two fleet workers' records of one test, which
# gave one machine two env_ids. A GPU's current PCIe link drops a generation when idle, and
# torch's thread count is a run setting (a fleet worker sets it, tests change it). All stay
# in the record, outside the id.
_VOLATILE = frozenset({"mem_total_bytes", "torch_threads", "pcie_gen", "pcie_width"})


def identity(env: dict[str, Any]) -> dict[str, Any]:
    """The fields of an environment record that env_id hashes: CPU, NUMA topology (not its
    memory sizes), GPUs (their maximum links) and versions (not torch's thread count)."""
    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in _VOLATILE}
        return [strip(x) for x in v] if isinstance(v, list) else v

    return strip({k: env[k] for k in ("cpu", "numa_nodes", "gpus", "versions")})


def huge_pages(root: Path) -> dict[str, Any]:
    """Transparent huge pages: the kernel's mode (the bracketed choice of
    /sys/kernel/mm/transparent_hugepage/enabled; None where unreadable) and whether torch
    asks for them (THP_MEM_ALLOC_ENABLE: allocations of 2 MiB and more aligned to 2 MiB and
    madvised, which the `kvbench` command turns on; kvbench.cli.main says why)."""
    mode = re.search(r"\[(\w+)\]",
                     read_file(root / "sys/kernel/mm/transparent_hugepage/enabled"))
    return {"mode": mode.group(1) if mode else None,
            "torch_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1"}


def collect_env(root: Path | str = "/") -> dict[str, Any]:
    """The full environment record, with a stable env_id over its identity fields."""
    root = Path(root)
    nodes = read_nodes(root)
    gpus, notes = gpu_info(root)
    if libnuma() is None:
        notes.append("libnuma unavailable: topology read from sysfs, placement unverified")
    from kvbench.native import native_status

    commit, dirty = git_state()
    env: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpu": cpu_info(root),
        "numa_nodes": [n.to_dict() for n in nodes],
        "memory_bytes": meminfo_total(read_file(root / "proc/meminfo")),
        "huge_pages": huge_pages(root),
        "cxl_devices": read_cxl_devices(root),
        "gpus": gpus,
        "versions": versions(),
        "libnuma": libnuma() is not None,
        "native_kernel": native_status(),
        "git_commit": commit,
        "git_dirty": dirty,
        "notes": notes,
    }
    ident = json.dumps(identity(env), sort_keys=True, default=str)
    env["env_id"] = hashlib.sha1(ident.encode()).hexdigest()[:12]
    return env
