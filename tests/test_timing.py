import statistics
from collections.abc import Callable

import pytest

from kvbench.timing import (
    Policy,
    Stats,
    Timing,
    block_medians,
    each_pass,
    kernel,
    kernel_ns,
    time_host,
    time_native,
    time_passes,
    time_rounds,
    time_stages,
)


def test_stats_match_definitions() -> None:
    samples = [5.0, 1.0, 3.0, 2.0, 4.0]
    st = Stats.of(samples)
    assert st.n == 5
    assert st.median == 3.0
    assert st.mean == 3.0
    assert (st.min, st.max) == (1.0, 5.0)
    assert st.iqr == pytest.approx(2.0)
    assert st.cv == pytest.approx(statistics.stdev(samples) / 3.0)
    assert st.p10 == pytest.approx(1.4)
    assert Stats.of([7.0]).cv == 0.0
    with pytest.raises(ValueError):
        Stats.of([])


def test_policy_min_reps_and_cap() -> None:
    calls = []
    t = time_host(lambda: calls.append(1), Policy(warmup=3, min_reps=7, min_time_s=0.0,
                                                  max_reps=100))
    assert len(t.seconds) == 7
    assert len(calls) == 10  # warm-up calls are made but not kept
    assert t.method() == {"timer": "perf_counter_ns", "warmup": 3, "reps": 7,
                          "statistic": "median"}
    capped = time_host(lambda: None, Policy(warmup=0, min_reps=5, min_time_s=60.0, max_reps=12))
    assert len(capped.seconds) == 12


def test_policy_min_time_keeps_repeating(monkeypatch) -> None:
    """On a fake clock: each call takes 10 ms, so 50 ms of min_time_s takes 5 samples (the
    clock is read before each sample, and the loop stops once 50 ms have passed), each of
    exactly 10 ms."""
    from fake_cuda import FakeCuda

    fake = FakeCuda().install(monkeypatch)
    t = time_host(lambda: fake.host(10_000_000), Policy(warmup=2, min_reps=1,
                                                         min_time_s=0.05, max_reps=10**6))
    assert t.seconds == (0.01,) * 5
    assert fake.host_ns == 70_000_000  # two untimed warm-up calls too


def test_gc_off_inside_the_timed_region_and_restored() -> None:
    """Decode timing runs with the cyclic GC off (as timeit); the caller's state comes back,
    also after an exception, and a disabled GC stays disabled."""
    import gc

    from kvbench.timing import gc_off

    assert gc.isenabled()
    with gc_off():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_off():
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_off():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_kernel_clock_counts_outermost_calls_on_this_thread_only(monkeypatch) -> None:
    """On a fake clock (tests/fake_cuda.py: perf_counter_ns advances only as told), an
    outer kernel of 10 ms around a nested one of 20 ms counts 30 ms exactly, once, and
    another thread's kernels are its own."""
    import threading

    from fake_cuda import FakeCuda

    fake = FakeCuda().install(monkeypatch)

    @kernel
    def inner() -> None:
        fake.host(20_000_000)

    @kernel
    def outer() -> None:
        inner()
        fake.host(10_000_000)

    k0 = kernel_ns()
    outer()  # 30 ms once, not 50 ms (inner nested)
    assert kernel_ns() - k0 == 30_000_000
    fake.host(5_000_000)  # outside any kernel: not counted
    inner()
    assert kernel_ns() - k0 == 50_000_000
    t = threading.Thread(target=inner)
    t.start()
    t.join()
    assert kernel_ns() - k0 == 50_000_000  # another thread's kernels are its own
    assert fake.host_ns == 75_000_000  # that thread's 20 ms did pass on the clock


def test_step_dispatch_is_wall_less_kernels_waits_and_carried_blocks(monkeypatch) -> None:
    """On a fake clock: a step of 135 ms holds kernels (2 x 30 ms), a wait (20 ms) and a
    carried block (20 ms, with a wait nested in it counted once); the dispatch task is what
    is left, 20 ms of the attention wrapper's own Python plus 15 ms after, exactly."""
    from fake_cuda import FakeCuda

    import kvbench.runtime.context as context
    from kvbench.runtime.context import Counters

    fake = FakeCuda().install(monkeypatch, context)
    ms = 1_000_000

    @kernel
    def matmul() -> None:
        fake.host(30 * ms)

    c = Counters(kv_heads=1, elem_bytes=4, n_layers=1)
    c.step = 1
    c.step_begin()
    t0 = fake.perf_counter_ns()
    matmul()
    with c.timed("attention"):  # a wrapper: its Python is dispatch, its kernel is not
        matmul()
        fake.host(20 * ms)
    with c.timed("accel_idle"):  # a wait
        fake.host(20 * ms)
    with c.timed("bookkeeping.x"):  # carried as its own task
        fake.host(10 * ms)
        with c.timed("accel_idle"):  # nested in a carried block: counted once
            fake.host(10 * ms)
    fake.host(15 * ms)
    assert fake.perf_counter_ns() - t0 == 135 * ms
    c.step_end((fake.perf_counter_ns() - t0) * 1e-9)
    last = c.graph.tasks[-1]
    assert (last.resource, last.op) == ("host", "dispatch")
    assert last.work["seconds"] == pytest.approx(0.035, rel=1e-12)  # 20 + 15 ms
    carried = [t for t in c.graph.tasks if t.op == "bookkeeping.x"]
    assert len(carried) == 1 and carried[0].work["seconds"] == pytest.approx(0.02, rel=1e-12)
    times = {(qn, w): steps[1] for qn, w, _, steps in c.series() if qn == "time"}
    assert times[("time", "attention")] == pytest.approx(0.05, rel=1e-12)
    assert times[("time", "accel_idle")] == pytest.approx(0.03, rel=1e-12)
    gpu = Counters(kv_heads=1, elem_bytes=4, cuda=True, n_layers=1)
    gpu.step_begin()
    gpu.step_end(0.1)
    assert not gpu.graph.tasks  # CUDA issues asynchronously: no dispatch task


def test_join_keeps_the_passes() -> None:
    a = Timing((1.0, 2.0), "perf_counter_ns", 1)
    b = Timing((3.0,), "perf_counter_ns", 1)
    j = Timing.join([a, b, a])
    assert j.seconds == (1.0, 2.0, 3.0, 1.0, 2.0) and j.blocks == (2, 1, 2)
    assert j.method()["blocks"] == [2, 1, 2] and j.method()["reps"] == 5
    assert "blocks" not in Timing.join([a]).method()


def test_passes_alternate_their_order_and_split_the_policy() -> None:
    calls: list[str] = []

    def task(name: str) -> Callable[[], str]:
        return lambda: calls.append(name) or f"{name}{len(calls)}"

    got = each_pass([task("a"), task("b"), task("c")], passes=3)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert got == [["a1", "a6", "a7"], ["b2", "b5", "b8"], ["c3", "c4", "c9"]]

    shares: list[Policy] = []

    def measure(p: Policy) -> Timing:
        shares.append(p)
        return Timing((float(len(shares)),) * p.min_reps, "perf_counter_ns", p.warmup)

    (t,) = time_passes([measure], Policy(warmup=1, min_reps=8, min_time_s=0.4), passes=4)
    assert [p.min_reps for p in shares] == [2] * 4 and shares[0].min_time_s == 0.1
    assert [p.warmup for p in shares] == [1, 0, 0, 0]  # warmed up in the first pass only
    assert t.blocks == (2, 2, 2, 2) and t.seconds == (1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0)


def test_time_cuda_one_call_per_event_pair_is_launch_bound(monkeypatch) -> None:
    """The CUDA-shaped fake (tests/fake_cuda.py): 150 us of host per launch, 10 us of device
    work. One call per event pair, nothing queued ahead: each sample is the launch, not the
    kernel (what the attention probe's GPU modes measured, audit finding 7)."""
    from fake_cuda import FakeCuda

    from kvbench.timing import time_cuda

    fake = FakeCuda(launch_ns=150_000).install(monkeypatch)
    t = time_cuda(lambda: fake.launch(10_000), Policy(warmup=1, min_reps=3, min_time_s=0.0))
    assert t.seconds == pytest.approx((160e-6,) * 3, rel=1e-12)
    assert t.calls == 1 and "calls_per_sample" not in t.method()


def test_time_cuda_covers_launches_and_divides_by_the_calls(monkeypatch) -> None:
    """cover + calls: the wait queued ahead of the start event outlasts the enqueue of the
    8 calls, which run back to back between one event pair; a sample is their device time
    over 8, exactly."""
    from fake_cuda import FakeCuda

    from kvbench.timing import COVER_TEXT, sleep_rate, time_cuda

    fake = FakeCuda(launch_ns=150_000, sleep_ghz=2.0).install(monkeypatch)
    t = time_cuda(lambda: fake.launch(10_000), Policy(warmup=1, min_reps=4, min_time_s=0.0),
                  calls=8, cover=True)
    assert t.seconds == pytest.approx((10e-6,) * 4, rel=1e-12)
    assert sleep_rate() == pytest.approx(2e9, rel=1e-12)
    assert t.method() == {"timer": "cuda_event", "warmup": 1, "reps": 4, "statistic": "median",
                          "calls_per_sample": 8, "before": COVER_TEXT, "launch_exposed": 0}
    # the last sample as queued: the wait, the start event, 8 calls, the end event
    assert fake.log[-11:] == ["sleep", "record", *["kernel"] * 8, "record"]
    assert fake.made == 4  # two to calibrate the wait, one pair reused by every sample


def test_time_cuda_counts_samples_whose_launches_outlast_the_wait(monkeypatch) -> None:
    """The warm-up enqueued fast (10 us), the first sample slowly (100 us): its calls waited
    for the host, which the timing says (exposed); the wait then grows and covers them."""
    from fake_cuda import FakeCuda

    from kvbench.timing import time_cuda

    fake = FakeCuda(launch_ns=10_000).install(monkeypatch)
    calls = []

    def step() -> None:
        calls.append(1)
        fake.launch_ns = 10_000 if len(calls) == 1 else 100_000
        fake.launch(5_000)

    t = time_cuda(step, Policy(warmup=1, min_reps=3, min_time_s=0.0), cover=True)
    assert t.exposed == 1 and t.method()["launch_exposed"] == 1
    assert t.seconds[0] > 5e-6 and t.seconds[1:] == pytest.approx((5e-6,) * 2, rel=1e-12)
    joined = Timing.join([t, t])
    assert joined.exposed == 2 and joined.calls == 1 and joined.cover == t.cover
    with pytest.raises(ValueError):
        time_cuda(step, calls=0)


# --- exact arithmetic of the policy, the statistics and the timers (issue 30) ---

@pytest.mark.parametrize(("reps", "elapsed", "done"), [
    (4, 1.0, False),   # time reached, too few samples
    (5, 0.19, False),  # samples reached, too little time
    (5, 0.2, True),    # both reached, exactly
    (999, 0.1, False), (1000, 0.0, True),  # max_reps, exactly
    (1, 10.0, True), (1, 0.19, False),  # max_time_s, exactly, once a sample is in
    (0, 10.0, False),  # never done without a sample
])
def test_policy_done_at_each_bound(reps: int, elapsed: float, done: bool) -> None:
    assert Policy().done(reps, elapsed) is done


def test_policy_share_divides_times_and_rounds_reps_up() -> None:
    p = Policy(warmup=3, min_reps=9, min_time_s=0.8, max_reps=100, max_time_s=4.0).share(4)
    assert p == Policy(warmup=3, min_reps=3, min_time_s=0.2, max_reps=25, max_time_s=1.0)
    assert Policy(min_reps=1, max_reps=2).share(8) == Policy(
        warmup=2, min_reps=1, min_time_s=0.2 / 8, max_reps=1, max_time_s=10.0 / 8)


def test_stats_percentiles_by_hand() -> None:
    # numpy's linear percentiles of 1..11: p10 = 2, p25 = 3.5, p75 = 8.5, p90 = 10
    st = Stats.of([float(x) for x in range(11, 0, -1)])
    assert (st.p10, st.median, st.p90, st.iqr) == (2.0, 6.0, 10.0, 5.0)
    assert st.to_dict()["p90"] == 10.0 and st.to_dict()["n"] == 11
    neg = Stats.of([-1.0, -3.0])  # cv is |std / mean|
    assert neg.cv == pytest.approx(2 ** 0.5 / 2, rel=1e-12)
    assert Stats.of([1.0, -1.0]).cv == 0.0  # mean 0: no cv


def test_block_medians() -> None:
    s = [1.0, 9.0, 5.0, 2.0, 4.0, 100.0]
    assert block_medians(s, [3, 3]) == [5.0, 4.0]
    assert block_medians(s, [1, 5]) == [1.0, 5.0]
    assert block_medians(s, [2, 2, 2]) == [5.0, 3.5, 52.0]
    assert block_medians(s, [6]) == [4.5]  # one block: the median of all
    assert block_medians(s, [3, 2]) == [4.5]  # blocks not covering the samples
    assert block_medians(s, [6, 0]) == [4.5]  # an empty block
    t = Timing(tuple(s), "perf_counter_ns", 0, (3, 3))
    assert t.pass_medians() == [5.0, 4.0] and t.median == 4.5


def test_time_native_keeps_the_returned_seconds(monkeypatch) -> None:
    from fake_cuda import FakeCuda

    fake = FakeCuda().install(monkeypatch)
    values = iter([9.0, 8.0, 1.0, 2.0, 3.0, 4.0])

    def fn() -> float:
        fake.host(30_000_000)
        return next(values)

    t = time_native(fn, Policy(warmup=2, min_reps=2, min_time_s=0.1), timer="x")
    assert t.seconds == (1.0, 2.0, 3.0, 4.0)  # 4 x 30 ms >= 100 ms; warm-up values dropped
    assert (t.timer, t.warmup) == ("x", 2)


def test_time_rounds_alternate_and_slice(monkeypatch) -> None:
    """Two quantities of 10 ms each a sample: a round takes 20 ms, the policy's times are per
    quantity (elapsed / 2), so 50 ms of min_time_s takes 5 rounds; 2 slices of 5 rounds are
    blocks of 2 and 3."""
    from fake_cuda import FakeCuda

    fake = FakeCuda().install(monkeypatch)
    order: list[str] = []

    def quantity(name: str, value: float) -> Callable[[], float]:
        def fn() -> float:
            order.append(name)
            fake.host(10_000_000)
            return value
        return fn

    a, b = time_rounds([quantity("a", 1.0), quantity("b", 2.0)],
                       Policy(warmup=1, min_reps=1, min_time_s=0.05), timer="t", slices=2)
    assert order == ["a", "b"] + ["a", "b", "b", "a"] * 2 + ["a", "b"]
    assert a.seconds == (1.0,) * 5 and b.seconds == (2.0,) * 5
    assert a.blocks == b.blocks == (2, 3) and (a.timer, a.warmup) == ("t", 1)
    (one,) = time_rounds([quantity("c", 3.0)], Policy(warmup=0, min_reps=3, min_time_s=0.0),
                         slices=5)
    assert one.blocks == (1, 1, 1)  # no more slices than rounds
    (whole,) = time_rounds([quantity("d", 4.0)], Policy(warmup=0, min_reps=3, min_time_s=0.0))
    assert whole.blocks == () and whole.timer == "CLOCK_MONOTONIC (native)"
    assert time_rounds([]) == []


def test_time_stages_time_each_stage_after_an_untimed_setup(monkeypatch) -> None:
    from fake_cuda import FakeCuda

    fake = FakeCuda().install(monkeypatch)
    seen: list[object] = []
    syncs: list[int] = []

    def setup() -> int:
        fake.host(1_000_000_000)  # untimed
        return len(seen)

    def fill(state: object) -> None:
        seen.append(state)
        fake.host(2_000_000)

    def compute(state: object) -> None:
        seen.append(state)
        fake.host(3_000_000)

    t_fill, t_compute = time_stages(setup, [fill, compute], Policy(warmup=1, min_reps=3,
                                                                   min_time_s=0.0),
                                    sync=lambda: syncs.append(1))
    assert t_fill.seconds == (0.002,) * 3 and t_compute.seconds == (0.003,) * 3
    assert seen == [0, 0, 2, 2, 4, 4, 6, 6]  # both stages get their repetition's state
    assert len(syncs) == 1 + 3 * 3  # after the warm-up; after setup and each stage
    assert t_fill.timer == "perf_counter_ns (device synchronised)" and t_fill.warmup == 1


def test_stats_in_float64_and_messages() -> None:
    import numpy as np

    st = Stats.of(np.array([2**24, 1, 1], dtype=np.float32))  # float32 would lose the ones
    assert st.mean == (2**24 + 2) / 3
    with pytest.raises(ValueError, match=r"^no samples$"):
        Stats.of([])
    assert Policy(min_reps=1, max_reps=100).share(3).max_reps == 33


def test_timing_method_and_join_keep_timer_warmup_blocks_and_calls() -> None:
    a = Timing((1.0,), "t", 3)
    b = Timing((2.0,), "t", 0)
    j = Timing.join([a, b])
    assert (j.timer, j.warmup, j.blocks) == ("t", 3, (1, 1))
    assert j.method()["blocks"] == [1, 1]
    assert Timing((1.0,), "t", 0, calls=2).method()["calls_per_sample"] == 2
    assert "calls_per_sample" not in Timing((1.0,), "t", 0, calls=1).method()


def test_time_native_default_timer(monkeypatch) -> None:
    from fake_cuda import FakeCuda

    FakeCuda().install(monkeypatch)
    t = time_native(lambda: 1.0, Policy(warmup=0, min_reps=2, min_time_s=0.0))
    assert t.timer == "CLOCK_MONOTONIC (native)" and t.seconds == (1.0, 1.0)


def test_time_cuda_warmup_cover_and_a_late_clock(monkeypatch) -> None:
    """The fake clock starts 100 s in (timings are differences of the clock, never sums);
    without cover no wait is queued or calibrated and there is no warm-up unless asked;
    with cover at least one warm-up round."""
    from fake_cuda import FakeCuda

    from kvbench import timing
    from kvbench.timing import time_cuda

    fake = FakeCuda(launch_ns=1_000).install(monkeypatch)
    fake.host(100 * 10**9)
    with pytest.raises(ValueError, match=r"^time_cuda: calls >= 1, and cover or before, "
                                         r"not both$"):
        time_cuda(lambda: None, calls=0)
    plain = time_cuda(lambda: fake.launch(10_000), Policy(warmup=0, min_reps=3,
                                                          min_time_s=0.0))
    assert plain.warmup == 0 and plain.seconds == pytest.approx((11e-6,) * 3, rel=1e-9)
    assert plain.cover == "" and "before" not in plain.method()
    assert "sleep" not in fake.log and timing._SLEEP_RATE == {}
    covered = time_cuda(lambda: fake.launch(10_000), Policy(warmup=0, min_reps=3,
                                                            min_time_s=0.0), cover=True)
    assert covered.warmup == 1 and covered.exposed == 0 and len(covered.seconds) == 3
    assert covered.cover and list(timing._SLEEP_RATE) == [0]  # keyed by the device


def test_time_cuda_a_launch_exactly_as_long_as_the_wait_is_covered(monkeypatch) -> None:
    """Warm-up enqueue 10 us, so the first sample's wait is 20 us; its enqueue takes 20 us:
    not longer than the wait, not exposed."""
    from fake_cuda import FakeCuda

    from kvbench.timing import time_cuda

    fake = FakeCuda(launch_ns=10_000).install(monkeypatch)
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        fake.launch_ns = 10_000 if len(calls) == 1 else 20_000
        fake.launch(1_000)

    t = time_cuda(step, Policy(warmup=1, min_reps=1, min_time_s=0.0), cover=True)
    assert t.exposed == 0 and len(t.seconds) == 1


def test_time_stages_on_a_late_clock(monkeypatch) -> None:
    from fake_cuda import FakeCuda

    fake = FakeCuda().install(monkeypatch)
    fake.host(100 * 10**9)
    (t,) = time_stages(lambda: None, [lambda s: fake.host(1_000_000)],
                       Policy(warmup=0, min_reps=3, min_time_s=0.0))
    assert t.seconds == (0.001,) * 3
