"""Timer probe: the cost and granularity of the clocks every other probe relies on.

Reports the overhead of one perf_counter_ns read (host timer of kvbench.timing), of one
native CLOCK_MONOTONIC read (the C probes' clock), of one small torch op per device (the
dispatch or launch overhead a hardware profile charges per task launch, kvbench.hwmodel),
and on a GPU the smallest interval a pair of CUDA events reports around an empty region
(the floor of device timings).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvbench.options import check_ranges, config_command, opt
from kvbench.probes import PROBES, Probe, run_and_store
from kvbench.schema import Record, measured, not_measured
from kvbench.timing import Policy, time_cuda


@dataclass(frozen=True)
class TimerConfig:
    """Options of `kvbench probe timer` (and of a suite's timer case)."""

    calls: int = opt(10_000, "Timer reads per repetition.", min=100)
    reps: int = opt(15, "Timed repetitions.", min=3)

    def __post_init__(self) -> None:
        check_ranges(self)


@PROBES.register
class TimerProbe(Probe):
    """Overhead of the host, native and CUDA-event timers (the floor of every timing)."""

    name = "timer"
    version = "1"
    config = TimerConfig

    def run(self, config: TimerConfig) -> Iterator[Record]:
        params = {"calls": config.calls}
        method = {"timer": "perf_counter_ns", "warmup": 1, "reps": config.reps,
                  "statistic": "median", "per": f"mean over {config.calls} back-to-back reads"}
        yield measured("probe", self.name, "perf_counter_ns_overhead", "ns", "lower",
                       self._host_reads(config), params, method)
        try:
            from kvbench.native import lib

            so = lib()
        except Exception as e:  # KvbenchError when not built
            yield not_measured("probe", self.name, "native_clock_overhead", "waived", str(e),
                               params)
        else:
            yield measured("probe", self.name, "native_clock_overhead", "ns", "lower",
                           self._native_reads(so, config), params, method)
        yield from self._ops(config)
        yield from self._cuda(config)

    def _ops(self, config: TimerConfig) -> Iterator[Record]:
        """Seconds per small torch op (an in-place add on 64 floats) issued back to back:
        dispatch cost on the CPU; on a GPU the launch rate (synchronised once per rep)."""
        import torch

        devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        for dev in devices:
            x = torch.zeros(64, device=dev)
            calls = min(config.calls, 2000)
            samples = []
            for rep in range(config.reps + 1):
                if dev != "cpu":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    x.add_(1.0)
                if dev != "cpu":
                    torch.cuda.synchronize(dev)
                if rep:
                    samples.append((time.perf_counter_ns() - t0) / calls * 1e-3)
            yield measured("probe", self.name, "op_overhead", "us", "lower", samples,
                           {"device": dev, "calls": calls},
                           {"timer": "perf_counter_ns", "warmup": 1, "reps": config.reps,
                            "statistic": "median",
                            "per": f"mean over {calls} back-to-back in-place adds of 64 "
                                   "floats"})

    @staticmethod
    def _host_reads(config: TimerConfig) -> list[float]:
        clock = time.perf_counter_ns
        samples = []
        for rep in range(config.reps + 1):
            t0 = clock()
            for _ in range(config.calls):
                clock()
            if rep:  # first repetition is the warm-up
                samples.append((clock() - t0) / config.calls)
        return samples

    @staticmethod
    def _native_reads(so, config: TimerConfig) -> list[float]:
        samples = []
        for rep in range(config.reps + 1):
            t0 = time.perf_counter_ns()
            for _ in range(config.calls):
                so.kvb_now_ns()
            if rep:
                samples.append((time.perf_counter_ns() - t0) / config.calls)
        return samples

    def _cuda(self, config: TimerConfig) -> Iterator[Record]:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is None or not torch.cuda.is_available():
            yield not_measured("probe", self.name, "cuda_event_floor", "waived",
                               "no CUDA GPU on this machine", {"calls": config.calls})
            return
        t = time_cuda(lambda: None, Policy(warmup=3, min_reps=config.reps, min_time_s=0.0,
                                           max_reps=config.reps))
        yield measured("probe", self.name, "cuda_event_floor", "us", "lower",
                       [s * 1e6 for s in t.seconds], {"calls": config.calls}, t.method())


def _cli(config: TimerConfig, out: Path | None) -> None:
    from kvbench.console import show_record, wrote

    wrote(run_and_store(TimerProbe(), config, out, show_record))


TimerProbe.cli = config_command([(TimerConfig, None)], _cli,
                                "Measure the overhead of kvbench's timers.")
