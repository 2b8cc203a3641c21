"""A CUDA-shaped fake of torch.cuda's timing surface, so CUDA timing code runs on the CPU.

`FakeCuda` models one stream on one device in simulated time: the host clock (what
`perf_counter_ns` returns to the modules it is installed in) advances by `launch_ns` for
every launch; a launched kernel starts when both the host has issued it and the device has
finished what was queued before (the device then runs it for its device time); an event
records the device time at which the stream reaches it. `install` puts it in place of
torch.cuda.Event / synchronize / _sleep / current_device and of the given modules' `time`.
Everything is deterministic: tests assert exact seconds, no wall time.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import pytest


class FakeCuda:
    """Simulated host and device clocks (ns), a log of what was queued, events made/live."""

    def __init__(self, launch_ns: int = 0, sleep_ghz: float = 1.0) -> None:
        self.host_ns = 0
        self.free_ns = 0  # the device is busy until then
        self.launch_ns = launch_ns
        self.sleep_ghz = sleep_ghz
        self.log: list[str] = []  # "kernel", "sleep", "record", "synchronize" in order
        self.made = 0  # events constructed
        self.live: weakref.WeakSet[Any] = weakref.WeakSet()
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing, "timing events need enable_timing=True"
                self.at: int | None = None
                fake.made += 1
                fake.live.add(self)

            def record(self, stream: Any = None) -> None:
                self.at = max(fake.free_ns, fake.host_ns)
                fake.free_ns = self.at
                fake.log.append("record")

            def synchronize(self) -> None:
                assert self.at is not None, "synchronize on an unrecorded event"
                fake.host_ns = max(fake.host_ns, self.at)

            def elapsed_time(self, end: Event) -> float:
                if self.at is None or end.at is None or fake.host_ns < end.at:
                    raise RuntimeError("event not recorded or not complete")
                return (end.at - self.at) / 1e6

        self.Event = Event

    def perf_counter_ns(self) -> int:
        return self.host_ns

    def launch(self, device_ns: int, what: str = "kernel") -> None:
        """The host issues one kernel of `device_ns` of device time."""
        self.host_ns += self.launch_ns
        self.free_ns = max(self.free_ns, self.host_ns) + device_ns
        self.log.append(what)

    def host(self, ns: int) -> None:
        """Host work of `ns` that queues nothing."""
        self.host_ns += ns

    def synchronize(self) -> None:
        self.host_ns = max(self.host_ns, self.free_ns)
        self.log.append("synchronize")

    def _sleep(self, cycles: int) -> None:
        self.launch(round(cycles / self.sleep_ghz), "sleep")

    def install(self, monkeypatch: pytest.MonkeyPatch, *modules: Any) -> FakeCuda:
        """Stand in for torch.cuda's timing calls, and for `time` in `modules`."""
        import torch

        import kvbench.timing

        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.synchronize())
        monkeypatch.setattr(torch.cuda, "_sleep", self._sleep)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(kvbench.timing, "_SLEEP_RATE", {})
        clock = types.SimpleNamespace(perf_counter_ns=self.perf_counter_ns)
        for m in (kvbench.timing, *modules):
            monkeypatch.setattr(m, "time", clock)
        return self
