"""GPU energy (kvbench.runtime.energy) reads the run's GPU, found in NVML by its PCI address,
not NVML device 0 (audit finding #20)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvbench.runtime.energy import Meter

BUSES = {"00000000:3b:00.0": "gpu-a", "00000000:86:00.0": "gpu-b"}


class FakeNvml:
    """Two GPUs; NVML's order (PCI) is not CUDA's: CUDA device 1 is NVML's first, at 3b."""

    def __init__(self) -> None:
        self.mj = {"gpu-a": 1000, "gpu-b": 5000}

    def nvmlInit(self) -> None: ...

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:  # what the meter read before
        return ["gpu-a", "gpu-b"][i]

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> str:
        return BUSES[bus]

    def nvmlDeviceGetTotalEnergyConsumption(self, h: str) -> int:
        return self.mj[h]


@pytest.mark.parametrize(("current", "bus", "handle"), [(0, 0x86, "gpu-b"), (1, 0x3B, "gpu-a")])
def test_gpu_energy_is_the_run_devices(current: int, bus: int, handle: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    nv = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    props = {0: 0x86, 1: 0x3B}  # CUDA's fastest-first order
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        pci_domain_id=0, pci_bus_id=props[i], pci_device_id=0))
    m = Meter(cuda=True)
    m.start()
    nv.mj[handle] += 2500  # only the run's GPU did work: 2.5 J
    m.stop()
    (rec,) = [r for r in m.records("full", {}, 5) if r.params["where"] == "accel"]
    assert rec.status == "ok" and rec.value == pytest.approx(2.5 / 5) and m.gpu_why == ""
    assert rec.method["counter"] == f"NVML total energy of cuda:{current} at PCI " \
                                    f"00000000:{bus:02x}:00.0"


def test_gpu_without_nvml_address_is_waived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        pci_domain_id=0, pci_bus_id=0x99, pci_device_id=0))
    m = Meter(cuda=True)
    assert m.gpu is None and "NVML total energy not readable" in m.gpu_why


# --- RAPL arithmetic and reasons, by hand (issue 30) ---

def _pkg(root, n: int, uj: int | str, top: int = 10_000_000):
    pkg = root / f"sys/class/powercap/intel-rapl:{n}"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "energy_uj").write_text(f"{uj}\n")
    (pkg / "max_energy_range_uj").write_text(f"{top}\n")
    return pkg


def test_rapl_sums_packages_per_token_with_its_method(tmp_path) -> None:
    """Two packages: 3 J and 1 J over the run, 8 tokens: 0.5 J/token; a sub-domain's
    counter (intel-rapl:0:0) is not added."""
    a, b = _pkg(tmp_path, 0, 1_000_000), _pkg(tmp_path, 1, 5_000_000)
    sub = tmp_path / "sys/class/powercap/intel-rapl:0:0"
    sub.mkdir()
    (sub / "energy_uj").write_text("7\n")
    m = Meter(tmp_path)
    assert m.pkgs == [a, b] and m.host_why == ""
    m.start()
    (a / "energy_uj").write_text("4000000\n")
    (b / "energy_uj").write_text("6000000\n")
    (sub / "energy_uj").write_text("999999999\n")
    m.stop()
    assert m.j == {"host": pytest.approx(4.0, rel=1e-12)}
    host, accel = m.records("full", {"batch": 2}, 8)
    assert (host.name, host.metric, host.unit, host.direction) == (
        "full", "energy_per_token", "J/token", "lower")
    assert host.value == pytest.approx(0.5, rel=1e-12) and host.params == {"batch": 2,
                                                                            "where": "host"}
    assert host.method["joules"] == pytest.approx(4.0, rel=1e-12) and host.kind == "run"
    assert (accel.kind, accel.name, accel.metric) == ("run", "full", "energy_per_token")
    assert host.method["counter"] == "RAPL package energy_uj"
    assert host.method["per"] == ("timed run (prefill + decode): counter difference / 8 "
                                  "generated tokens")
    assert accel.params == {"batch": 2, "where": "accel"} and accel.reason == "no GPU in this run"


def test_rapl_wrap_adds_every_packages_range_once(tmp_path) -> None:
    a = _pkg(tmp_path, 0, 9_000_000, top=10_000_000)
    _pkg(tmp_path, 1, 0, top=30_000_000)
    m = Meter(tmp_path)
    m.start()
    (a / "energy_uj").write_text("500000\n")  # down 8.5 J: wrapped; + 40 J of ranges
    m.stop()
    assert m.j["host"] == pytest.approx(31.5, rel=1e-12)


@pytest.mark.parametrize(("setup", "why"), [
    ("none", "no powercap sysfs ({root}/sys/class/powercap): RAPL not exposed on this "
             "machine"),
    ("empty", "powercap has no intel-rapl package domains"),
    ("unreadable", "RAPL energy_uj not readable (ValueError: needs root?)"),
])
def test_rapl_waived_with_the_reason(tmp_path, setup: str, why: str) -> None:
    if setup != "none":
        (tmp_path / "sys/class/powercap").mkdir(parents=True)
    if setup == "unreadable":
        _pkg(tmp_path, 0, "x")
    m = Meter(tmp_path)
    assert m.pkgs == [] and m.host_why == why.format(root=tmp_path)
    m.start()
    m.stop()
    assert m.j == {}
    (host, _) = m.records("full", {}, 1)
    assert host.status == "waived" and host.reason == m.host_why and host.value is None


def test_gpu_without_nvml_module_is_waived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    m = Meter(cuda=True)
    assert m.gpu is None and m.gpu_why == "nvidia-ml-py not installed (pip install kvbench[gpu])"


@pytest.mark.parametrize("uj", [1_000_000, 1_500_000])
def test_rapl_no_or_little_energy_is_not_a_wrap(tmp_path, uj: int) -> None:
    a = _pkg(tmp_path, 0, 1_000_000)
    m = Meter(tmp_path)
    m.start()
    (a / "energy_uj").write_text(f"{uj}\n")  # 0 J, then 0.5 J: no wrap
    m.stop()
    assert m.j["host"] == pytest.approx((uj - 1_000_000) * 1e-6, abs=1e-12)
