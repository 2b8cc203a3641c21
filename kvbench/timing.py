"""The one timing module: warm-up, adaptive repetitions, every sample kept, robust statistics.

Host work is timed with time.perf_counter_ns; device work with CUDA events on the stream
that runs it (torch is imported only when device timing is asked for). A measurement keeps
all samples and the method that produced them, so a record can say how it was measured.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import numpy as np


@dataclass(frozen=True)
class Policy:
    """How long to measure: `warmup` untimed calls, then repetitions until both `min_reps`
    and `min_time_s` are reached, stopping at `max_reps` or `max_time_s` whichever first."""

    warmup: int = 2
    min_reps: int = 5
    min_time_s: float = 0.2
    max_reps: int = 1000
    max_time_s: float = 10.0

    def done(self, reps: int, elapsed_s: float) -> bool:
        if reps >= self.max_reps or (reps >= 1 and elapsed_s >= self.max_time_s):
            return True
        return reps >= self.min_reps and elapsed_s >= self.min_time_s

    def share(self, passes: int) -> Policy:
        """One pass's share of this policy when a quantity is timed in `passes` passes:
        times divided among them, repetitions too (rounded up: at least one a pass)."""
        least = max(1, -(-self.min_reps // passes))
        return Policy(self.warmup, least, self.min_time_s / passes,
                      max(least, self.max_reps // passes), self.max_time_s / passes)


QUICK = Policy(warmup=1, min_reps=3, min_time_s=0.0, max_reps=50, max_time_s=2.0)
DEFAULT = Policy()
PASSES = 8  # passes (or slices of rounds) a probe spreads each quantity's samples over


@dataclass(frozen=True)
class Stats:
    """Summary of a sample set; cv is std/mean (0 for one sample), iqr is p75 - p25."""

    n: int
    median: float
    mean: float
    p10: float
    p90: float
    min: float
    max: float
    iqr: float
    cv: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        a = np.asarray(samples, dtype=np.float64)
        if a.size == 0:
            raise ValueError("no samples")
        p10, p25, p50, p75, p90 = np.percentile(a, [10, 25, 50, 75, 90])
        mean = float(a.mean())
        cv = float(a.std(ddof=1) / mean) if a.size > 1 and mean != 0 else 0.0
        return cls(
            n=int(a.size),
            median=float(p50),
            mean=mean,
            p10=float(p10),
            p90=float(p90),
            min=float(a.min()),
            max=float(a.max()),
            iqr=float(p75 - p25),
            cv=abs(cv),
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def block_medians(samples: Sequence[float], blocks: Sequence[int]) -> list[float]:
    """The median of each block of consecutive samples (a pass, Timing.join); one median of
    all samples when the blocks are fewer than two or do not partition the samples."""
    if len(blocks) < 2 or sum(blocks) != len(samples) or min(blocks) < 1:
        return [float(np.median(samples))]
    ends = np.cumsum(blocks)
    return [float(np.median(samples[e - b:e])) for b, e in zip(blocks, ends, strict=True)]


@dataclass(frozen=True)
class Timing:
    """Seconds per call for every timed repetition, and how they were taken. `blocks`: the
    sample counts of the passes the samples were taken in, in order (`Timing.join`); empty
    for one pass. `calls`: calls of the timed function per sample (a sample is their time
    divided by it). `cover`: what was queued on the device ahead of each sample to keep the
    host's launch time out of it (time_cuda), and `exposed` how many samples' launches
    outlasted it all the same (their calls may have waited for the host)."""

    seconds: tuple[float, ...]
    timer: str
    warmup: int
    blocks: tuple[int, ...] = ()
    calls: int = 1
    cover: str = ""
    exposed: int = 0

    @property
    def stats(self) -> Stats:
        return Stats.of(self.seconds)

    @property
    def median(self) -> float:
        return self.stats.median

    def pass_medians(self) -> list[float]:
        """The median of each pass's samples (the median of all with one pass)."""
        return block_medians(self.seconds, self.blocks)

    @classmethod
    def join(cls, passes: Sequence[Timing]) -> Timing:
        """One timing of the samples of several passes over a quantity taken at different
        times of a run; `blocks` keeps which samples each pass took (the units that are
        nearly independent on a machine whose speed drifts over seconds, kvbench.compare)."""
        first = passes[0]
        return cls(tuple(s for t in passes for s in t.seconds), first.timer, first.warmup,
                   tuple(len(t.seconds) for t in passes), first.calls, first.cover,
                   sum(t.exposed for t in passes))

    def method(self) -> dict[str, Any]:
        out: dict[str, Any] = {"timer": self.timer, "warmup": self.warmup,
                               "reps": len(self.seconds), "statistic": "median"}
        if len(self.blocks) > 1:
            out["blocks"] = list(self.blocks)
        if self.calls > 1:
            out["calls_per_sample"] = self.calls
        if self.cover:
            out.update(before=self.cover, launch_exposed=self.exposed)
        return out


GC_OFF = "Python's cyclic GC off in the timed region (as timeit), one collection before"


@contextmanager
def gc_off() -> Iterator[None]:
    """Python's cyclic garbage collector off while timing, as timeit does, after one full
    collection; its previous state restored after. A decode loop allocates enough objects
    (per-layer trace tasks, tensors' Python wrappers) to start collections that walk every
    live object, the model's included: 13% of a batch-1 decode step of the bundled model
    on the main thread (perf), added at random steps."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _KernelClock(threading.local):
    ns = 0  # wall time inside modelled kernels on this thread, summed
    depth = 0  # nesting: a kernel that calls another counts once


_CLOCK = _KernelClock()


def kernel_ns() -> int:
    """Wall nanoseconds this thread has spent inside `kernel`-wrapped calls so far.

    A CPU run's trace (kvbench.runtime.context.Counters) subtracts it from each step's
    wall time: what is left of the step is dispatch (Python, small torch ops), carried into
    projections as measured; the kernels themselves are modelled from their work."""
    return _CLOCK.ns


def kernel(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: `fn`'s wall time (outermost call on this thread) goes into kernel_ns()."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        c = _CLOCK
        if c.depth:
            return fn(*args, **kwargs)
        c.depth = 1
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            c.ns += time.perf_counter_ns() - t0
            c.depth = 0

    return wrapped


def time_host(fn: Callable[[], object], policy: Policy = DEFAULT) -> Timing:
    """Time fn() on the host with perf_counter_ns, one sample per call."""
    for _ in range(policy.warmup):
        fn()
    samples: list[float] = []
    start = time.perf_counter_ns()
    while not policy.done(len(samples), (time.perf_counter_ns() - start) * 1e-9):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) * 1e-9)
    return Timing(tuple(samples), "perf_counter_ns", policy.warmup)


def time_native(fn: Callable[[], float], policy: Policy = DEFAULT,
                timer: str = "CLOCK_MONOTONIC (native)") -> Timing:
    """Repeat fn() under policy, where fn times itself (in native code, probes/) and returns
    the seconds per operation of one sample; the samples are those returned values."""
    for _ in range(policy.warmup):
        fn()
    samples: list[float] = []
    start = time.perf_counter_ns()
    while not policy.done(len(samples), (time.perf_counter_ns() - start) * 1e-9):
        samples.append(fn())
    return Timing(tuple(samples), timer, policy.warmup)


T = TypeVar("T")


def each_pass(tasks: Sequence[Callable[[], T]], passes: int = PASSES) -> list[list[T]]:
    """Call every task once per pass, in list order on even passes and reversed on odd ones
    (no task always runs first, or after the same neighbour); returns each task's results
    in pass order."""
    got: list[list[T]] = [[] for _ in tasks]
    order = list(range(len(tasks)))
    for r in range(passes):
        for i in order if r % 2 == 0 else order[::-1]:
            got[i].append(tasks[i]())
    return got


def time_passes(measures: Sequence[Callable[[Policy], Timing]], policy: Policy = DEFAULT,
                passes: int = PASSES) -> list[Timing]:
    """Time several quantities in `passes` passes (each_pass): a pass calls every
    measure(p) with its share of the policy (Policy.share), so the samples of each quantity
    are spread over the whole measurement and a machine whose speed drifts over seconds
    reaches every quantity alike. A quantity warms up in its first pass only: later passes
    find it past its first-call costs, and a warm-up per pass had made the roofline's
    2-second CPU prefill point cost twice its samples. Returns each quantity's samples
    joined, with its passes as blocks (Timing.join)."""
    first = policy.share(passes)
    later = replace(first, warmup=0)
    calls = [0] * len(measures)

    def call(i: int) -> Timing:
        calls[i] += 1
        return measures[i](first if calls[i] == 1 else later)

    return [Timing.join(g) for g in
            each_pass([functools.partial(call, i) for i in range(len(measures))], passes)]


def time_rounds(fns: Sequence[Callable[[], float]], policy: Policy = DEFAULT,
                timer: str = "CLOCK_MONOTONIC (native)", slices: int = 1) -> list[Timing]:
    """Time several self-timed quantities (each fn as in time_native) in interleaved rounds:
    a round takes one sample of every fn, in list order on even rounds and reversed on odd
    ones, so slow drift of the machine reaches every quantity alike and no quantity always
    follows the same neighbour. `policy.warmup` untimed rounds first; rounds go on until
    policy.done(rounds, elapsed / len(fns)), so the policy's times are per quantity.
    `slices` > 1 cuts the rounds into that many consecutive runs of rounds, recorded as the
    timings' blocks (Timing.join): slices of time in which every quantity was sampled."""
    if not fns:
        return []
    order = list(range(len(fns)))
    for _ in range(policy.warmup):
        for i in order:
            fns[i]()
    samples: list[list[float]] = [[] for _ in fns]
    rounds = 0
    start = time.perf_counter_ns()
    while not policy.done(rounds, (time.perf_counter_ns() - start) * 1e-9 / len(fns)):
        for i in order if rounds % 2 == 0 else order[::-1]:
            samples[i].append(fns[i]())
        rounds += 1
    k = min(slices, rounds)
    blocks = tuple(rounds * (j + 1) // k - rounds * j // k for j in range(k)) if k > 1 else ()
    return [Timing(tuple(s), timer, policy.warmup, blocks) for s in samples]


COVER = 2.0  # time_cuda's device wait: this many times the host's time to enqueue a sample
COVER_TEXT = ("torch.cuda._sleep queued ahead of the start event, twice the host's time to "
              "enqueue the previous round's calls")
_SLEEP_PROBE = 10_000_000  # cycles of the one timed torch.cuda._sleep that calibrates it
_SLEEP_RATE: dict[int, float] = {}  # CUDA device index -> torch.cuda._sleep cycles a second


def sleep_rate() -> float:
    """Cycles a second of torch.cuda._sleep on the current CUDA device (its SM clock),
    timed once with CUDA events and kept for the process."""
    import torch

    dev = torch.cuda.current_device()
    if dev not in _SLEEP_RATE:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SLEEP_PROBE // 10)  # untimed: covers the timed one's launch
        e0.record()
        torch.cuda._sleep(_SLEEP_PROBE)
        e1.record()
        e1.synchronize()
        _SLEEP_RATE[dev] = _SLEEP_PROBE / (e0.elapsed_time(e1) * 1e-3)
    return _SLEEP_RATE[dev]


def time_cuda(
    fn: Callable[[], object],
    policy: Policy = DEFAULT,
    before: Callable[[], object] | None = None,
    calls: int = 1,
    cover: bool = False,
) -> Timing:
    """Time fn() on the current CUDA stream with CUDA events: `calls` calls of fn between
    one pair of events, a sample being the pair's time divided by `calls`.

    `before`, when given, is enqueued ahead of the start event each repetition (for example
    a short device-side wait) so that the host's launch overhead of fn is hidden behind it.
    `cover` queues such a wait itself, sized to COVER times the host's time to enqueue the
    previous round's calls (the last warm-up round's for the first sample; at least one
    warm-up round): the device then runs the calls back to back and a sample is their
    device time, not the host's launch rate (torch ops of a few microseconds of device
    work each take several of host time). Samples whose enqueue outlasted the wait are
    counted (Timing.exposed).
    """
    import torch

    if calls < 1 or (cover and before is not None):
        raise ValueError("time_cuda: calls >= 1, and cover or before, not both")
    warmup = max(policy.warmup, 1) if cover else policy.warmup
    enqueue = 0.0  # host seconds to enqueue the previous round's calls
    for _ in range(warmup):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        enqueue = (time.perf_counter_ns() - t0) * 1e-9
    torch.cuda.synchronize()
    rate = sleep_rate() if cover else 0.0
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: list[float] = []
    exposed = 0
    start = time.perf_counter_ns()
    while not policy.done(len(samples), (time.perf_counter_ns() - start) * 1e-9):
        wait = COVER * enqueue
        if cover:
            torch.cuda._sleep(int(wait * rate))
        elif before is not None:
            before()
        e0.record()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        took = (time.perf_counter_ns() - t0) * 1e-9
        e1.record()
        e1.synchronize()
        if cover:
            exposed += int(took > wait)
            enqueue = took
        samples.append(e0.elapsed_time(e1) * 1e-3 / calls)
    return Timing(tuple(samples), "cuda_event", warmup, calls=calls,
                  cover=COVER_TEXT if cover else "", exposed=exposed)


def time_stages(setup: Callable[[], Any], stages: Sequence[Callable[[Any], object]],
                policy: Policy = DEFAULT, sync: Callable[[], object] = lambda: None
                ) -> list[Timing]:
    """Time dependent stages, one sample of each per repetition: `setup()` (untimed) makes
    the state every stage of that repetition receives, then each stage runs in order and is
    timed with perf_counter_ns between device synchronisations (`sync`). For work that
    consumes its input (a fresh cache to fill, then the compute on it)."""
    for _ in range(policy.warmup):
        state = setup()
        for stage in stages:
            stage(state)
        sync()
    samples: list[list[float]] = [[] for _ in stages]
    start = time.perf_counter_ns()
    while not policy.done(len(samples[0]), (time.perf_counter_ns() - start) * 1e-9):
        state = setup()
        sync()
        for stage, out in zip(stages, samples, strict=True):
            t0 = time.perf_counter_ns()
            stage(state)
            sync()
            out.append((time.perf_counter_ns() - t0) * 1e-9)
    return [Timing(tuple(s), "perf_counter_ns (device synchronised)", policy.warmup)
            for s in samples]
