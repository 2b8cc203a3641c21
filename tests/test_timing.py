import statistics

import pytest

from kvbench.timing import Policy, Stats, time_host


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


def test_policy_min_time_keeps_repeating() -> None:
    t = time_host(lambda: sum(range(1000)), Policy(warmup=0, min_reps=1, min_time_s=0.05,
                                                   max_reps=10**6))
    assert sum(t.seconds) >= 0.04
    assert all(s > 0 for s in t.seconds)


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
