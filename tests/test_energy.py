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
    assert rec.status == "ok" and rec.value == pytest.approx(2.5 / 5)
    assert rec.method["counter"] == f"NVML total energy of cuda:{current} at PCI " \
                                    f"00000000:{bus:02x}:00.0"


def test_gpu_without_nvml_address_is_waived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        pci_domain_id=0, pci_bus_id=0x99, pci_device_id=0))
    m = Meter(cuda=True)
    assert m.gpu is None and "NVML total energy not readable" in m.gpu_why
