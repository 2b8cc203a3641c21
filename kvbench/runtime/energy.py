"""Measured energy of a run's decode (issue 14): host package energy from RAPL (powercap
sysfs, /sys/class/powercap/intel-rapl:N/energy_uj, one counter per package, wrapping at
max_energy_range_uj) and GPU energy from NVML's total-energy counter (mJ since the driver
loaded, Volta and later) of the run's GPU: torch's current device, which is the run's
(kvbench.runtime.run.resolve), found in NVML by its PCI address, since CUDA's device order
(fastest first, CUDA_VISIBLE_DEVICES) need not be NVML's. Each is read before and after
the timed run (prefill and decode) and divided by the tokens it generated; a device whose
counter cannot be read gets a waived record saying why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbench.schema import ParamValue, Record, measured, not_measured


def _rapl(root: Path) -> tuple[list[Path], str]:
    base = root / "sys/class/powercap"
    if not base.is_dir():
        return [], f"no powercap sysfs ({base}): RAPL not exposed on this machine"
    pkgs = sorted(p for p in base.glob("intel-rapl:*") if p.name.count(":") == 1)
    if not pkgs:
        return [], "powercap has no intel-rapl package domains"
    try:
        for p in pkgs:
            int((p / "energy_uj").read_text())
    except (OSError, ValueError) as e:
        return [], f"RAPL energy_uj not readable ({e.__class__.__name__}: needs root?)"
    return pkgs, ""


def _pci_bus_id(index: int) -> str:
    """The PCI address (domain:bus:device.function) of CUDA device `index`, as NVML takes it."""
    import torch

    p = torch.cuda.get_device_properties(index)
    return f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


def _nvml() -> tuple[Any, str]:
    """((pynvml, handle, "cuda:N at BUS"), "") for the run's GPU, or (None, why not)."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        bus = _pci_bus_id(index)
        h = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
        return (pynvml, h, f"cuda:{index} at PCI {bus}"), ""
    except ImportError:
        return None, "nvidia-ml-py not installed (pip install kvbench[gpu])"
    except Exception as e:  # no driver, no GPU, or a GPU older than Volta
        return None, f"NVML total energy not readable: {e}"


class Meter:
    """Energy counters read around a region: `start()`, `stop()`, then `records(...)`."""

    def __init__(self, root: Path = Path("/"), cuda: bool = False) -> None:
        self.pkgs, self.host_why = _rapl(root)
        self.gpu, self.gpu_why = _nvml() if cuda else (None, "no GPU in this run")
        self.j: dict[str, float] = {}
        self._t0: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        out = {}
        if self.pkgs:
            out["host"] = sum(int((p / "energy_uj").read_text()) for p in self.pkgs) * 1e-6
        if self.gpu is not None:
            nv, h, _ = self.gpu
            out["accel"] = nv.nvmlDeviceGetTotalEnergyConsumption(h) * 1e-3
        return out

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> None:
        t1 = self._read()
        for k, v in t1.items():
            d = v - self._t0[k]
            if d < 0 and k == "host":  # a package counter wrapped once
                d += sum(int((p / "max_energy_range_uj").read_text()) for p in self.pkgs) \
                    * 1e-6
            self.j[k] = d

    def records(self, name: str, params: dict[str, ParamValue], tokens: int
                ) -> Iterator[Record]:
        """energy_per_token (J/token) per device over the timed run, or waived with the
        reason."""
        for where, why in (("host", self.host_why), ("accel", self.gpu_why)):
            p = {**params, "where": where}
            if where in self.j:
                yield measured("run", name, "energy_per_token", "J/token", "lower",
                               [self.j[where] / tokens], p,
                               {"per": f"timed run (prefill + decode): counter difference "
                                       f"/ {tokens} generated tokens",
                                "joules": self.j[where],
                                "counter": "RAPL package energy_uj" if where == "host"
                                else f"NVML total energy of {self.gpu[2]}"})
            else:
                yield not_measured("run", name, "energy_per_token", "waived", why, p)
