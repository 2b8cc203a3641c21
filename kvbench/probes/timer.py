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
from typing import Any

from kvbench.options import check_ranges, opt
from kvbench.probes import PROBES, Measure, Probe, RecordOf, in_passes
from kvbench.schema import Record, measured, not_measured
from kvbench.timing import PASSES, Policy, time_cuda, time_host


@dataclass(frozen=True)
class TimerConfig:
    """Options of `kvbench probe timer` (and of a suite's timer case)."""

    calls: int = opt(10_000, "Timer reads per repetition.", min=100)
    reps: int = opt(15, "Timed repetitions (spread over up to 8 passes, rounded up to a "
                    "multiple of them).", min=3)

    def __post_init__(self) -> None:
        check_ranges(self)


@PROBES.register
class TimerProbe(Probe):
    """Overhead of the host, native and CUDA-event timers (the floor of every timing)."""

    name = "timer"
    version = "1"
    config = TimerConfig
    description = "Measure the overhead of kvbench's timers."

    def run(self, config: TimerConfig) -> Iterator[Record]:
        """Every timer's quantity timed in passes (kvbench.timing.time_passes), config.reps
        repetitions of config.calls reads or ops in all, one warm-up, in the first pass."""
        import torch

        calls = config.calls
        params = {"calls": calls}
        reads = f"mean over {calls} back-to-back reads"
        todo: list[tuple[Measure, RecordOf]] = []

        def record(metric: str, unit: str, scale: float, prm: dict[str, Any],
                   extra: dict[str, str]) -> RecordOf:
            """The record of a timing of `scale`-th calls (seconds to `unit` per call)."""
            return lambda t: measured("probe", self.name, metric, unit, "lower",
                                      [x * scale for x in t.seconds], prm,
                                      {**t.method(), **extra})

        def host_reads() -> None:
            clock = time.perf_counter_ns
            for _ in range(calls):
                clock()

        todo.append((lambda p: time_host(host_reads, p),
                     record("perf_counter_ns_overhead", "ns", 1e9 / calls, params, {"per": reads})))
        try:
            from kvbench.native import lib

            so = lib()
        except Exception as e:  # KvbenchError when not built
            yield not_measured("probe", self.name, "native_clock_overhead", "waived", str(e),
                               params)
        else:
            def native_reads() -> None:
                for _ in range(calls):
                    so.kvb_now_ns()

            todo.append((lambda p: time_host(native_reads, p),
                         record("native_clock_overhead", "ns", 1e9 / calls, params,
                                {"per": reads})))
        ops = min(calls, 2000)
        for dev in ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]:
            todo.append((self._ops(dev, ops), record(
                "op_overhead", "us", 1e6 / ops, {"device": dev, "calls": ops},
                {"per": f"mean over {ops} back-to-back in-place adds of 64 floats"})))
        if torch.cuda.is_available():
            todo.append((lambda p: time_cuda(lambda: None, p),
                         record("cuda_event_floor", "us", 1e6, params, {})))
        else:
            yield not_measured("probe", self.name, "cuda_event_floor", "waived",
                               "no CUDA GPU on this machine", params)
        yield from in_passes(todo, Policy(warmup=1, min_reps=config.reps, min_time_s=0.0,
                                          max_reps=config.reps), min(PASSES, config.reps))

    @staticmethod
    def _ops(dev: str, calls: int) -> Measure:
        """measure(policy): seconds per `calls` small torch ops (an in-place add on 64
        floats) issued back to back: dispatch cost on the CPU; on a GPU the launch rate
        (synchronised once per repetition)."""
        import torch

        x = torch.zeros(64, device=dev)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev != "cpu" else (lambda: None)

        def ops() -> None:
            for _ in range(calls):
                x.add_(1.0)
            sync()

        return lambda policy: time_host(ops, policy)
