import json
import os
import sys
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.envinfo import collect_env, identity, pcie_link_gbps
from kvbench.errors import KvbenchError
from kvbench.topology import get_node, parse_cpulist, read_cxl_devices, read_nodes


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("\n") == ()


def test_fake_topology(fake_sysfs: Path) -> None:
    nodes = read_nodes(fake_sysfs)
    assert [n.id for n in nodes] == [0, 1, 2]
    assert nodes[0].cpus == (0, 1, 2, 3) and not nodes[0].memory_only
    assert nodes[2].cpus == () and nodes[2].memory_only
    assert nodes[2].mem_total_bytes == 64 << 30
    assert nodes[1].distances == (21, 10, 24)
    assert get_node(2, fake_sysfs).memory_only
    with pytest.raises(KvbenchError, match=r"NUMA node 7 does not exist .*nodes: 0, 1, 2"):
        get_node(7, fake_sysfs)
    cxl = read_cxl_devices(fake_sysfs)
    assert cxl[0] == {"name": "mem0", "numa_node": 2, "ram_size": 64 << 30}
    assert cxl[1] == {"name": "region0"}


def test_no_numa_dir_falls_back_to_one_node(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal:  1024 kB\n")
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/online").write_text("0-5\n")
    (node,) = read_nodes(tmp_path)
    assert node.cpus == tuple(range(6)) and node.mem_total_bytes == 1 << 20


def test_env_record_on_fake_tree(fake_sysfs: Path) -> None:
    env = collect_env(fake_sysfs)
    assert env["cpu"]["model"] == "Fake Xeon 8480"
    assert env["cpu"]["logical_cpus"] == 8 and env["cpu"]["physical_cores"] == 8
    assert env["cpu"]["caches"][0]["size"] == "105M"
    assert [n["memory_only"] for n in env["numa_nodes"]] == [False, False, True]
    assert env["memory_bytes"] == 96 << 30
    assert env["cxl_devices"][0]["numa_node"] == 2
    assert env["versions"]["python"]
    assert len(env["env_id"]) == 12
    assert collect_env(fake_sysfs)["env_id"] == env["env_id"]  # stable


def test_env_id_ignores_state_that_changes_while_a_machine_runs(
        fake_sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A VM's MemTotal moves with its balloon, a GPU's current link with its power state,
    torch's thread count with the run: the same machine keeps its env_id. Its CPU does not."""
    import torch

    env = collect_env(fake_sysfs)
    (fake_sysfs / "proc/meminfo").write_text(f"MemTotal:       {90 * 1024 * 1024} kB\n")
    node = fake_sysfs / "sys/devices/system/node/node0/meminfo"
    node.write_text(node.read_text().replace(str(16 * 1024 * 1024), str(15 * 1024 * 1024)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        moved = collect_env(fake_sysfs)
    finally:
        torch.set_num_threads(threads)
    assert moved["memory_bytes"] == 90 << 30 and moved["numa_nodes"][0]["mem_total_bytes"] \
        == 15 << 30  # recorded as read ...
    assert moved["versions"]["torch_threads"] != env["versions"]["torch_threads"]
    assert moved["env_id"] == env["env_id"]  # ... but not part of the identity
    gpu = {"index": 0, "name": "H100", "pcie_gen": 5, "pcie_width": 16, "pcie_gen_max": 5}
    idle = {**gpu, "pcie_gen": 1}
    assert identity({**env, "gpus": [gpu]}) == identity({**env, "gpus": [idle]})
    assert identity({**env, "gpus": [gpu]}) != identity({**env, "gpus": [{**gpu, "name": "A100"}]})
    cpuinfo = fake_sysfs / "proc/cpuinfo"
    cpuinfo.write_text(cpuinfo.read_text().replace("Fake Xeon 8480", "Fake Xeon 6980"))
    assert collect_env(fake_sysfs)["env_id"] != env["env_id"]


def test_env_cli_json(fake_sysfs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["env", "--json", "--root", str(fake_sysfs)])
    assert e.value.code == 0
    env = json.loads(capsys.readouterr().out)
    assert env["numa_nodes"][2]["memory_only"] is True


def test_env_cli_table_flags_memory_only(fake_sysfs: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["env", "--root", str(fake_sysfs)])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "memory-only" in out and "mem0 (node 2)" in out and "Fake Xeon 8480" in out


def test_pcie_rates() -> None:
    assert pcie_link_gbps(4, 16) == pytest.approx(31.5, rel=0.01)
    assert pcie_link_gbps(5, 16) == pytest.approx(63.0, rel=0.01)


class FakeNvml:
    """Stands in for pynvml: one H100 on PCIe gen5 x16 at bus 0000:3b:00.0."""

    class Info:
        total = 80 * 10**9
        busId = b"00000000:3B:00.0"

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: return "580.1"
    def nvmlDeviceGetCount(self) -> int: return 1
    def nvmlDeviceGetHandleByIndex(self, i: int) -> int: return i
    def nvmlDeviceGetName(self, h: int) -> bytes: return b"NVIDIA H100 PCIe"
    def nvmlDeviceGetPciInfo(self, h: int) -> "FakeNvml.Info": return self.Info()
    def nvmlDeviceGetMemoryInfo(self, h: int) -> "FakeNvml.Info": return self.Info()
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int: return 4
    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int: return 8
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int: return 5
    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int: return 16


def test_gpu_through_nvml(fake_sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pci = fake_sysfs / "sys/bus/pci/devices/0000:3b:00.0"
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text("1\n")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    (gpu,) = collect_env(fake_sysfs)["gpus"]
    assert gpu["name"] == "NVIDIA H100 PCIe" and gpu["numa_node"] == 1
    assert (gpu["pcie_gen"], gpu["pcie_width"]) == (4, 8)
    assert (gpu["pcie_gen_max"], gpu["pcie_width_max"]) == (5, 16)
    assert gpu["pcie_link_gbps_max"] == pytest.approx(63.0, rel=0.01)
    assert gpu["driver"] == "580.1" and gpu["memory_bytes"] == 80 * 10**9


class NotSupported(Exception):
    """Stands in for pynvml.NVMLError_NotSupported."""


# FakeNvml query -> the GPU record fields it fills (the rest must still be read)
PER_GPU = {
    "nvmlDeviceGetName": ("name",),
    "nvmlDeviceGetMemoryInfo": ("memory_bytes",),
    "nvmlDeviceGetPciInfo": ("pci_bus_id", "numa_node"),
    "nvmlDeviceGetCurrPcieLinkGeneration": ("pcie_gen",),
    "nvmlDeviceGetCurrPcieLinkWidth": ("pcie_width",),
    "nvmlDeviceGetMaxPcieLinkGeneration": ("pcie_gen_max", "pcie_link_gbps_max"),
    "nvmlDeviceGetMaxPcieLinkWidth": ("pcie_width_max", "pcie_link_gbps_max"),
    "nvmlDeviceGetHandleByIndex": ("name", "memory_bytes", "pci_bus_id", "numa_node",
                                   "pcie_gen", "pcie_width", "pcie_gen_max",
                                   "pcie_width_max", "pcie_link_gbps_max"),
    "nvmlSystemGetDriverVersion": ("driver",),
}


@pytest.mark.parametrize("query", sorted(PER_GPU))
def test_each_refused_nvml_query_is_none_and_a_note(
        query: str, fake_sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU audit finding 1: NVML refusing one query (NotSupported for the PCIe link under
    vGPU, confidential computing, gVisor) leaves that field None with a note; every other
    field is still read and the record is still collected."""
    pci = fake_sysfs / "sys/bus/pci/devices/0000:3b:00.0"
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text("1\n")
    full = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", full)
    (whole,) = collect_env(fake_sysfs)["gpus"]
    refusing = FakeNvml()

    def refuse(*args: object) -> None:
        raise NotSupported("Not Supported")

    setattr(refusing, query, refuse)
    monkeypatch.setitem(sys.modules, "pynvml", refusing)
    env = collect_env(fake_sysfs)
    (gpu,) = env["gpus"]
    assert gpu.keys() == whole.keys()
    for key, value in whole.items():
        assert gpu[key] == (None if key in PER_GPU[query] else value), key
    assert [n for n in env["notes"] if "NVML" in n] == [n for n in env["notes"]
                                                        if "NotSupported" in n]
    assert len([n for n in env["notes"] if "NotSupported: Not Supported" in n]) == 1


def test_refused_pcie_queries_keep_every_command_alive(
        fake_sysfs: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """All four PCIe link queries refused: `kvbench env` (the record every probe and run
    stores) exits 0 and says what NVML would not tell."""
    nv = FakeNvml()

    def refuse(*args: object) -> None:
        raise NotSupported("Not Supported")

    for query in ("nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
                  "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"):
        setattr(nv, query, refuse)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    with pytest.raises(SystemExit) as e:
        main(["env", "--json", "--root", str(fake_sysfs)])
    assert e.value.code == 0
    env = json.loads(capsys.readouterr().out)
    (gpu,) = env["gpus"]
    assert gpu["name"] == "NVIDIA H100 PCIe" and gpu["pcie_link_gbps_max"] is None
    assert sum("GPU 0 pcie_" in n for n in env["notes"]) == 4


def test_nvml_without_a_device_count_lists_gpus_through_torch(
        fake_sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML that cannot count its GPUs: a note, and the GPUs torch sees (none here)."""
    nv = FakeNvml()

    def refuse() -> None:
        raise NotSupported("Unknown Error")

    nv.nvmlDeviceGetCount = refuse
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    env = collect_env(fake_sysfs)
    assert env["gpus"] == []
    assert any(n.startswith("NVML device count: NotSupported") for n in env["notes"])


def test_missing_pynvml_is_a_note(fake_sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    env = collect_env(fake_sysfs)
    assert any("pynvml not installed" in n for n in env["notes"])


def test_huge_pages_mode_and_torch_setting(fake_sysfs: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's bracketed THP mode and whether torch asks for huge pages are recorded;
    an unreadable mode is None, not an error."""
    thp = fake_sysfs / "sys/kernel/mm/transparent_hugepage"
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert collect_env(fake_sysfs)["huge_pages"] == {"mode": None, "torch_alloc": False}
    thp.mkdir(parents=True)
    (thp / "enabled").write_text("always [madvise] never\n")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert collect_env(fake_sysfs)["huge_pages"] == {"mode": "madvise", "torch_alloc": True}


def test_the_command_asks_torch_for_huge_pages_unless_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvbench` sets THP_MEM_ALLOC_ENABLE=1 for its torch (before torch's first large
    allocation in a fresh process); a user's own value stands."""
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    with pytest.raises(SystemExit):
        main(["list", "--help"])
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    with pytest.raises(SystemExit):
        main(["list", "--help"])
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
