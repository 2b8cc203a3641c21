"""Bandwidth probe method (issue 3): interleaved rounds, the stability statistics, --repeat,
which memcpy store path a copy takes, and when the GPU bars run (audit finding #20)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.memory import Endpoint
from kvbench.probes import _copy, bandwidth
from kvbench.probes._bandwidth_stats import CV_BAR, cv_by_size, stability
from kvbench.probes._copy import HostCopier, Pair
from kvbench.probes._gpu_copy import GpuCopier
from kvbench.probes.bandwidth import BandwidthConfig, BandwidthProbe, series
from kvbench.store import load
from kvbench.timing import Policy, Timing, time_rounds

H0 = Endpoint("host", 0)
M = 1 << 20


def test_time_rounds_interleaves_and_alternates() -> None:
    calls: list[str] = []

    def fn(name: str, value: float) -> Callable[[], float]:
        def f() -> float:
            calls.append(name)
            return value
        return f

    ts = time_rounds([fn("a", 1.0), fn("b", 2.0), fn("c", 3.0)],
                     Policy(warmup=1, min_reps=3, min_time_s=0.0, max_reps=3))
    assert calls == list("abc" "abc" "cba" "abc")  # warm-up round, then alternating rounds
    assert [t.seconds for t in ts] == [(1.0,) * 3, (2.0,) * 3, (3.0,) * 3]
    assert all(t.warmup == 1 and t.timer.startswith("CLOCK_MONOTONIC") for t in ts)
    assert time_rounds([], Policy()) == []


def test_cv_by_size_is_the_cv_of_each_size_across_sweeps() -> None:
    sweeps = [{4096: 1.0, M: 8.0, 4 * M: 10.0}, {4096: 9.0, M: 10.0, 4 * M: 10.0},
              {M: 12.0, 4 * M: 10.0}]
    cvs = cv_by_size(sweeps)
    assert list(cvs) == [M, 4 * M]  # below 1M and sizes missing from a sweep are left out
    assert cvs[M] == pytest.approx(2.0 / 10.0)  # std (ddof 1) of 8, 10, 12 over their mean
    assert cvs[4 * M] == 0.0
    assert cv_by_size([]) == {}


def test_stability_record_is_the_median_of_the_per_size_cvs() -> None:
    cvs = {M: 0.01, 4 * M: 0.09, 16 * M: 0.03, 64 * M: 0.02}
    rec = next(stability("bandwidth", "repeat_cv_median_ge_1m", cvs, {"src": "host:0"}, 0.5,
                         "how", True))
    assert rec.samples == [0.01, 0.09, 0.03, 0.02] and rec.value == pytest.approx(0.025)
    assert rec.method["sizes"] == "1M,4M,16M,64M" and rec.method["loadavg_1m_start"] == 0.5
    assert rec.method["pass"] is True and str(CV_BAR) in rec.method["bar"]
    within = next(stability("bandwidth", "cv_median_ge_1m", {M: 0.2}, {}, 0.0, "how", False))
    assert within.value == 0.2 and "pass" not in within.method
    assert list(stability("bandwidth", "cv_median_ge_1m", {}, {}, 0.0, "how", False)) == []


def test_repeat_validates_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(cli(["probe", "bandwidth", "--src", "host:0", "--dst", "host:0",
                            "--repeat", "0"], capsys), "--repeat")


def test_repeat_writes_every_sweep_and_the_stability_bar(tmp_path: Path) -> None:
    out = tmp_path / "bw.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "64K,1M,4M",
              "--pageable", "--quick", "--no-bars", "--repeat", "2", "--out", str(out)])
    assert e.value.code == 0
    recs = load(out).records
    bw = [r for r in recs if r["metric"] == "bandwidth" and r["status"] == "ok"]
    assert [(r["params"]["size"], r["method"]["repeat"]) for r in bw] == [
        (65536, "1/2"), (M, "1/2"), (4 * M, "1/2"), (65536, "2/2"), (M, "2/2"), (4 * M, "2/2")]
    assert all(r["method"]["order"].startswith("interleaved") for r in bw)
    assert len({r["stats"]["n"] for r in bw[:3]}) == 1  # one sample per size per round
    bar = next(r for r in recs if r["metric"] == "repeat_cv_median_ge_1m")
    by_size = {(r["params"]["size"], r["method"]["repeat"]): r["value"] for r in bw}
    expected = cv_by_size([{s: by_size[s, f"{i}/2"] for s in (65536, M, 4 * M)} for i in (1, 2)])
    assert bar["samples"] == pytest.approx(list(expected.values()))
    assert bar["method"]["sizes"] == "1M,4M" and bar["method"]["pass"] == (bar["value"] < CV_BAR)
    assert sum(r["metric"] == "cv_median_ge_1m" for r in recs) == 2
    assert [k.split()[-1] for k in series(recs, "bandwidth", "bandwidth")] == ["1/2", "2/2"]


def test_stores_follow_glibc_non_temporal_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    copier = HostCopier(Pair(H0, H0), "pageable", 4 * M, 2, False)
    try:
        monkeypatch.setattr(_copy, "nt_threshold", lambda: 2 * M)
        assert copier.stores(M) == "regular"
        assert copier.stores(4 * M) == "non-temporal"  # two threads, 2M each
        monkeypatch.setattr(_copy, "nt_threshold", lambda: 2 * M + 1)
        assert copier.stores(4 * M + 64) == "non-temporal/regular"  # chunks 2M and 2M + 64
        monkeypatch.setattr(_copy, "nt_threshold", lambda: None)
        assert copier.stores(4 * M) == "unknown"
    finally:
        copier.close()


def test_nt_threshold_reads_what_glibc_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    found = _copy.nt_threshold.__wrapped__()
    if found is None:
        pytest.skip("not glibc on x86 (no x86_non_temporal_threshold tunable)")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.x86_non_temporal_threshold=0x100000")
    assert _copy.nt_threshold.__wrapped__() == 0x100000


def test_copy_threads_may_run_on_every_cpu_of_their_node() -> None:
    """Threads = CPUs: each copy thread is pinned to its node's CPU set, not one CPU, so it
    can leave a CPU that something else wants (issue 11: one-CPU pins fell behind a plain
    unpinned loop at all-core threads)."""
    from kvbench.memory import runner_cpus

    cpus = runner_cpus(0)
    if len(cpus) < 2:
        pytest.skip("needs a node with two CPUs this process may use")
    copier = HostCopier(Pair(H0, H0), "pageable", 4 * M, len(cpus), False)
    try:
        assert copier.sampler(M)(2) > 0
        assert copier.cpus_per_thread == len(cpus)
        assert copier.sampler(64, latency=True)(2) > 0  # the one latency thread as well
        assert copier.cpus_per_thread == len(cpus)
    finally:
        copier.close()


def test_sweep_view_never_redraws_during_a_measurement(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The live table is drawn when records arrive, with no refresh thread of its own that
    could take a CPU from a copy thread in the middle of a sample."""
    import threading

    from rich.live import _RefreshThread

    from kvbench.console import console

    seen: list[tuple[bool, bool]] = []  # per sweep: live area up, a refresh thread alive
    sweep = HostCopier.sweep

    def watched(self: HostCopier, sizes: list[int], policy: Policy) -> dict:
        seen.append((bool(console._live_stack),
                     any(isinstance(t, _RefreshThread) for t in threading.enumerate())))
        return sweep(self, sizes, policy)

    monkeypatch.setattr(HostCopier, "sweep", watched)
    out = tmp_path / "bw.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "64K",
              "--pageable", "--quick", "--no-bars", "--repeat", "2", "--out", str(out)])
    assert e.value.code == 0
    assert seen == [(False, False), (True, False)]  # the 2nd sweep runs under the live view
    bw = [r for r in load(out).records if r["metric"] == "bandwidth"]
    assert all(r["method"]["cpus_per_thread"] >= 1 for r in bw)


def test_pair_directions_name_the_device_d() -> None:
    g0, g1 = Endpoint("gpu", 0), Endpoint("gpu", 1)
    assert [Pair(a, b).direction for a, b in ((H0, g0), (g0, H0), (g0, g1), (H0, H0))] == [
        "h2d", "d2h", "d2d", "h2h"]
    plan = _copy.Plan([Pair(g0, g1)], [], ["pageable", "pinned"], [], [4096])
    assert plan.kinds_of(plan.pairs[0]) == ["device"] and plan.steps == 1


class StubGpu(GpuCopier):
    """A torch-engine copier without CUDA: every copy takes 1 ms, the torch loop 4 GB/s."""

    def __init__(self, pair: Pair, kind: str, span: int, bidirectional: bool) -> None:
        self.buffers, self.span = [], span
        self.routes = [(None, None)] * (2 if bidirectional else 1)

    def timing(self, size: int, policy: Policy, latency: bool = False) -> Timing:
        return Timing((1e-3,) * 3, "cuda_event", 1)

    def torch_loop_gbps(self, size: int, reps: int = 10, rounds: int = 5) -> list[float]:
        return [4.0, 2.0]

    def close(self) -> None: ...


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gpu_bars_run_for_pinned_h2d_in_one_direction_only(
        bidirectional: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned H2D with the torch engine gets its bars (probe / torch loop, per loop round);
    with --bidirectional the probe moves both directions at once, so they are waived
    (they divided one direction's bytes by both directions' time)."""
    monkeypatch.setattr(_copy, "gpu_count", lambda: 1)
    monkeypatch.setattr(bandwidth, "open_copier",
                        lambda pair, kind, size, threads, bidir, root, engine:
                        StubGpu(pair, kind, 256 * M, bidir))
    cfg = BandwidthConfig(src="host:0", dst="gpu:0", memory="pinned", sizes="4K",
                          bidirectional=bidirectional, quick=True)
    recs = {r.metric: r for r in BandwidthProbe().run(cfg)}
    loop, link = recs["torch_loop_ratio"], recs["pcie_link_ratio"]
    assert loop.params["size"] == 256 * M and loop.params["engine"] == "torch"
    if bidirectional:
        assert {loop.status, link.status} == {"waived"} and "--bidirectional" in loop.reason
    else:
        probe = 256 * M / 1e-3 / 1e9
        assert loop.samples == [probe / 4.0, probe / 2.0]
        assert link.status == "waived" and "NVML" in link.reason  # no NVML link here


@pytest.mark.parametrize("bidirectional", [False, True])
def test_bandwidth_is_bytes_moved_over_seconds(bidirectional: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: every GB/s sample of a host sweep is size x routes / seconds per copy / 1e9,
    counted here: one route (host:0 -> host:0), two with --bidirectional (both ways at
    once). The copier's timings are fixed so the identity is exact."""
    monkeypatch.setattr(_copy, "nt_threshold", lambda: 1 << 30)
    monkeypatch.setattr(bandwidth, "nt_threshold", lambda: 1 << 30)
    routes = 2 if bidirectional else 1
    secs = {4096: (1e-6, 2e-6, 5e-7), 65536: (1e-5, 4e-5, 3e-5)}
    c = HostCopier(Pair(H0, H0), "pageable", M, 1, bidirectional)
    try:
        assert len(c.routes) == routes
        monkeypatch.setattr(c, "sweep", lambda sizes, policy: {
            s: (Timing(secs[s], "CLOCK_MONOTONIC (native)", 1), 7) for s in sizes})
        recs = BandwidthProbe()._sweep(c, [4096, 65536], Policy(), {"threads": 1}, "1/1")
    finally:
        c.close()
    assert [r.params["size"] for r in recs] == [4096, 65536]
    assert recs[0].samples == [4096 * routes / s / 1e9 for s in secs[4096]]
    assert recs[1].samples == [65536 * routes / s / 1e9 for s in secs[65536]]
    assert recs[0].value == 4096 * routes / 1e-6 / 1e9  # the median sample
    assert recs[1].value == 65536 * routes / 3e-5 / 1e9
    assert all(r.unit == "GB/s" and r.method["copies_per_sample"] == 7 for r in recs)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gpu_sweep_counts_each_route_once(bidirectional: bool) -> None:
    """The torch engine's GB/s: 4 KiB per route in 1 ms, one or two routes."""
    c = StubGpu(Pair(H0, Endpoint("gpu", 0)), "pinned", M, bidirectional)
    (rec,) = BandwidthProbe()._sweep(c, [4096], Policy(), {"engine": "torch"}, "1/1")
    assert rec.samples == [4096 * (2 if bidirectional else 1) / 1e-3 / 1e9] * 3
