"""The copy probes' plumbing (kvbench/probes/_copy.py) that no CPU sweep reaches on its own
(issue 30): which copier a pair gets and with what buffers, the C memcpy reference per
thread count, and the records waived for pairs and memory kinds this machine cannot run."""

from __future__ import annotations

import ctypes
import math

import pytest

from kvbench.memory import Endpoint, runner_cpus
from kvbench.probes import _copy
from kvbench.probes._copy import NO_GPU, Pair, Plan, host_memcpy_ref, open_copier

H0, H1, G0, G1 = Endpoint("host", 0), Endpoint("host", 1), Endpoint("gpu", 0), Endpoint("gpu", 1)


@pytest.fixture
def copiers(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple], list[object]]:
    """Each copier class replaced by one that records (class, arguments), and the roots
    asked for their last-level cache: 1000 bytes, so buffers span max(max_size, 2000)."""
    made: list[tuple] = []

    def fake(name: str):
        return lambda *args: made.append((name, args)) or name

    for cls in ("HostCopier", "GpuCopier", "CupyCopier"):
        monkeypatch.setattr(_copy, cls, fake(cls))
    roots: list[object] = []
    monkeypatch.setattr(_copy, "llc_bytes", lambda root: roots.append(root) or 1000)
    return made, roots


def test_each_pair_gets_its_engines_copier_with_its_buffers(copiers: tuple) -> None:
    made, roots = copiers
    assert open_copier(Pair(H0, H1), "pinned", 5000, 3, True, "/fake") == "HostCopier"
    assert open_copier(Pair(H0, G0), "pageable", 100, 3, False) == "GpuCopier"  # torch
    assert open_copier(Pair(G0, H1), "pinned", 100, 1, True, engine="cupy") == "CupyCopier"
    assert open_copier(Pair(G0, G1), "device", 4000, 1, False, engine="torch") == "GpuCopier"
    assert made == [("HostCopier", (Pair(H0, H1), "pinned", 5000, 3, True, "/fake")),
                       ("GpuCopier", (Pair(H0, G0), "pageable", 2000, False)),
                       ("CupyCopier", (Pair(G0, H1), "pinned", 2000, True)),
                       ("GpuCopier", (Pair(G0, G1), "device", 4000, False))]
    assert roots == ["/fake", "/", "/", "/"]  # the machine's own sysfs by default


class _So:
    """A native library double: records each memcpy call, returns 5000 ns."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def kvb_memcpy_loop(self, *args: int) -> int:
        self.calls.append(("loop", args))
        return 5000

    def kvb_memcpy_threads(self, *args: int) -> int:
        self.calls.append(("threads", args))
        return 5000


def test_memcpy_reference_one_loop_or_threads_and_its_seconds() -> None:
    so = _So()
    assert host_memcpy_ref(so, 11, 22, 4096, 1) == pytest.approx(5e-6)
    assert host_memcpy_ref(so, 11, 22, 4096, 3) == pytest.approx(5e-6)
    assert so.calls == [("loop", (11, 22, 4096, 1)), ("threads", (11, 22, 4096, 1, 3))]


@pytest.mark.parametrize("threads", [1, 2])
def test_memcpy_reference_copies_the_bytes(threads: int) -> None:
    from kvbench.native import lib

    n = 1 << 16
    src = (ctypes.c_ubyte * n)(*(i % 251 for i in range(n)))
    dst = (ctypes.c_ubyte * n)()
    seconds = host_memcpy_ref(lib(), ctypes.addressof(dst), ctypes.addressof(src), n, threads)
    assert seconds > 0 and bytes(dst) == bytes(src)


def test_waived_records_for_pairs_and_memory_this_machine_lacks() -> None:
    plan = Plan([Pair(H0, H1), Pair(G0, G1)], [("host:0", "gpu:0")], ["pageable"], ["pinned"],
                [1024])
    got = [(r.kind, r.name, r.metric, r.status, r.reason, r.params)
           for r in plan.waived("bandwidth", "bandwidth", {"threads": 2})]
    assert got == [
        ("probe", "bandwidth", "bandwidth", "waived", NO_GPU,
         {"src": "host:0", "dst": "gpu:0", "threads": 2}),
        ("probe", "bandwidth", "bandwidth", "waived", "pinned memory needs CUDA "
         "(cudaHostRegister)", {"src": "host:0", "dst": "host:1", "memory": "pinned",
                                "threads": 2})]  # none for gpu:0->gpu:1: device memory


def test_copies_per_sample_from_the_fastest_of_three_calibrations() -> None:
    """iters = ceil(SAMPLE_S / fastest per-copy time so far), 1 to 2^22, after 3 samples."""
    seen: list[int] = []

    def sample(times: list[float]):
        it = iter(times)
        return lambda iters: seen.append(iters) or next(it)

    def want(per: float) -> int:
        return math.ceil(_copy.SAMPLE_S / per)

    assert _copy.SAMPLE_S == 2e-3
    assert _copy.copies_per_sample(sample([4e-6, 1e-6, 8e-6])) == want(1e-6)  # the fastest
    assert seen == [1, want(4e-6), want(1e-6)]
    seen.clear()
    assert _copy.copies_per_sample(sample([1e-13, 1e-13, 1e-13])) == 1 << 22  # capped
    assert _copy.copies_per_sample(sample([3e-3, 5e-3, 4e-3])) == 1  # one copy is enough
    assert _copy.copies_per_sample(sample([0.0, 0.0, 0.0])) == 1 << 22  # no zero division
    assert _copy.copies_per_sample(sample([3e-7, 9e-7, 9e-7])) == want(3e-7) == 6667


def test_calibrated_times_the_sample_at_its_copies_under_the_policy(monkeypatch) -> None:
    got: list[tuple] = []
    monkeypatch.setattr(_copy, "time_native", lambda fn, policy: got.append((fn(), policy)))
    calls: list[int] = []
    _copy.calibrated(lambda iters: calls.append(iters) or 1e-6)("POLICY")
    assert calls == [1, 2001, 2001, 2001] and got == [(1e-6, "POLICY")]


@pytest.mark.parametrize("windows, hop", [(1, 1), (2, 1), (3, 2), (4, 3), (10, 7), (12, 7),
                                          (100, 61), (1000, 619)])
def test_coprime_hop(windows: int, hop: int) -> None:
    """Near windows x 0.618, at least 2, the first coprime with windows at or above it."""
    assert _copy.coprime_hop(windows) == hop


def test_jobs_split_a_copy_or_scatter_a_latency_window() -> None:
    """Bandwidth: n = min(threads, size / 64) threads, chunks of size/n rounded down to a
    line, the last thread the rest, stride = size; latency: one fenced thread, stride rounded
    up to a line, windows over the buffer, a coprime hop. Per route, on the route's CPUs."""
    from kvbench.native import lib

    c = _copy.HostCopier(Pair(H0, H0), "pageable", 1 << 16, 3, True)
    try:
        (sb, db, cpus), (sb2, db2, _) = c.routes
        jobs, n = c._jobs(1000, False)
        assert n == 6  # 3 threads x 2 routes
        rows = [(j.dst, j.src, j.chunk, j.stride, j.windows, j.hop, j.start, j.ncpus, j.fence)
                for j in jobs]
        w = (1 << 16) // 1000  # (span - size) // stride + 1
        assert rows[:3] == [(db.ptr + o, sb.ptr + o, k, 1000, w, 1, 0, len(cpus), 0)
                            for o, k in ((0, 320), (320, 320), (640, 360))]
        assert rows[3][:2] == (db2.ptr, sb2.ptr)
        assert [jobs[k].cpus[i] for k in range(n) for i in range(jobs[k].ncpus)] == \
            [x for _ in range(6) for x in cpus]
        jobs, n = c._jobs(100, False)
        assert n == 2 and [jobs[k].chunk for k in range(n)] == [100, 100]  # 100 // 64 = 1
        jobs, n = c._jobs(128, False)
        assert n == 4 and [jobs[k].chunk for k in range(n)] == [64, 64, 64, 64]  # 2 lines
        assert len(c._cpu_sets) == 3 * 2 and all(x is not None for x in c._cpu_sets)
        jobs, n = c._jobs(100, True)
        windows = ((1 << 16) - 100) // 128 + 1
        assert n == 2 and (jobs[0].chunk, jobs[0].stride, jobs[0].windows, jobs[0].hop,
                           jobs[0].fence) == (100, 128, windows,
                                              _copy.coprime_hop(windows), 1)
        jobs, n = c._jobs(128, True)  # a whole line: no padding; one thread even so
        assert n == 2 and (jobs[0].chunk, jobs[0].stride) == (128, 128)
        assert c._jobs(1000, True)[1] == 2
        assert c.bytes_per_copy(100) == 200
        assert c.so is lib() and c.cpus == sorted(set(cpus))
        assert cpus == runner_cpus(0, "/") and len(c.buffers) == 4  # both routes' buffers
    finally:
        c.close()


def test_sampler_is_seconds_per_copy_and_refuses_a_failed_thread(monkeypatch) -> None:
    c = _copy.HostCopier(Pair(H0, H0), "pageable", 1 << 16, 2, False)
    try:
        ns = [8000]
        asked: list[tuple] = []

        class So:
            def kvb_copy_jobs(self, jobs, njobs, iters):
                asked.append((njobs, iters, jobs[0].fence))
                for k in range(njobs):
                    jobs[k].allowed = 5 - k
                return ns[0]

        c.so = So()
        sample = c.sampler(4096)
        assert sample(4) == pytest.approx(8000e-9 / 4) and asked == [(2, 4, 0)]  # no fence
        assert c.cpus_per_thread == 4  # the fewest any thread could run on
        ns[0] = 0
        with pytest.raises(_copy.KvbenchError, match=r"^native copy threads could not be "
                                                      r"created$"):
            sample(1)
        assert c.cpus_per_thread == 4
    finally:
        c.close()


def test_measure_and_sweep_hand_their_sampler_and_policy_on(monkeypatch) -> None:
    """measure: a bandwidth sampler unless latency is asked for; sweep: every size's sampler
    at its copies per sample, in time_rounds under the policy, in PASSES slices."""
    c = _copy.HostCopier(Pair(H0, H0), "pageable", 1 << 16, 1, False)
    try:
        made: list[tuple] = []
        c.sampler = lambda size, latency=False: made.append((size, latency)) or (
            lambda iters: iters / 2**30)
        monkeypatch.setattr(_copy, "calibrated", lambda sample: ("calibrated", sample(7)))
        assert c.measure(64) == ("calibrated", 7 / 2**30) and c.measure(32, True)
        assert made == [(64, False), (32, True)]
        monkeypatch.setattr(_copy, "copies_per_sample", lambda sample: round(sample(1) * 2**30) + 4)
        rounds: list[tuple] = []
        monkeypatch.setattr(_copy, "time_rounds", lambda fns, policy, slices: rounds.append(
            ([f() for f in fns], policy, slices)) or ["t64", "t128"])
        assert c.sweep([64, 128], "POLICY") == {64: ("t64", 5), 128: ("t128", 5)}
        assert rounds == [([5 / 2**30, 5 / 2**30], "POLICY", _copy.PASSES)]
    finally:
        c.close()


def test_plan_defaults_and_bad_memory_kind() -> None:
    assert _copy.make_plan("host:0", "host:0", "1K", "pageable") == \
        _copy.make_plan("host:0", "host:0", "1K", "pageable", "/")
    with pytest.raises(_copy.KvbenchError, match=r"^unknown memory kind 'nope' \(pageable, "
                                                  r"pinned or both\)$"):
        _copy.make_plan("host:0", "host:0", "1K", "nope")
