"""Memory probes (issue 3): endpoints, NUMA placement, native copies, bandwidth/latency CLIs."""

from __future__ import annotations

import ctypes
import statistics
from contextlib import ExitStack
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli, cuda_available

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.memory import (
    Endpoint,
    HostBuffer,
    check_endpoint,
    endpoints,
    parse_endpoint,
    runner_cpus,
    runner_node,
)
from kvbench.probes import _copy
from kvbench.probes._bandwidth_stats import at_fraction, derived
from kvbench.probes._copy import HostCopier, Pair, coprime_hop, plan_pairs
from kvbench.probes.latency import LatencyProbe
from kvbench.store import load
from kvbench.timing import QUICK, Policy, Timing, time_native
from kvbench.topology import libnuma

H0 = Endpoint("host", 0)


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    return assert_usage_error(cli(argv, capsys))


@pytest.mark.parametrize("sizes,msg", [("0", "greater than zero"), ("4Q", "cannot parse"),
                                       ("16K..4K", "smaller than the first"), ("", "empty"),
                                       ("1K,4K,...,100K", "not reached"), ("1.5", "whole")])
@pytest.mark.parametrize("probe", ["bandwidth", "latency"])
def test_bad_sizes_exit_2(probe: str, sizes: str, msg: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert msg in fails(["probe", probe, "--pageable", "--sizes", sizes], capsys)


@pytest.mark.parametrize("args,msg", [
    (["--src", "host:7"], "NUMA node 7 does not exist"),
    (["--dst", "host:3"], "NUMA node 3 does not exist"),
    (["--src", "cpu:0"], "cannot parse endpoint 'cpu:0'"),
    (["--src", ","], "empty endpoint list"),
])
def test_unknown_endpoint_exit_2(fake_sysfs: Path, args: list[str], msg: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    for probe in ("bandwidth", "latency"):
        assert msg in fails(["probe", probe, *args, "--root", str(fake_sysfs)], capsys)


@pytest.mark.skipif(cuda_available(), reason="checks the CPU-only refusals")
def test_gpu_requests_without_cuda_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert "no CUDA GPU" in fails(["probe", "bandwidth", "--dst", "gpu:0"], capsys)
    assert "--pinned needs CUDA" in fails(["probe", "bandwidth", "--pinned"], capsys)
    assert "--pinned needs CUDA" in fails(["probe", "latency", "--pinned"], capsys)


def test_other_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--threads" in fails(["probe", "bandwidth", "--pageable", "--threads", "0"], capsys)
    assert "only one of" in fails(["probe", "bandwidth", "--pinned", "--pageable"], capsys)
    assert "cannot parse size" in fails(["probe", "latency", "--chase-size", "x"], capsys)


def test_endpoint_parsing_and_memory_only_node(fake_sysfs: Path) -> None:
    assert parse_endpoint(" gpu:3 ") == Endpoint("gpu", 3) and str(H0) == "host:0"
    assert endpoints("host:0,host:0,", fake_sysfs, gpus=0) == [H0]
    assert endpoints(None, fake_sysfs, gpus=0) == [H0, Endpoint("host", 1), Endpoint("host", 2)]
    assert endpoints(None, fake_sysfs, gpus=2)[-2:] == [Endpoint("gpu", 0), Endpoint("gpu", 1)]
    check_endpoint(Endpoint("host", 2), fake_sysfs)  # memory-only CXL node is an endpoint
    with pytest.raises(KvbenchError, match="GPU 2 does not exist"):
        check_endpoint(Endpoint("gpu", 2), fake_sysfs, gpus=2)
    # node 2 has no CPUs: its accesses run on node 0 (distance 14, node 1 is 24)
    assert runner_node(2, fake_sysfs).id == 0
    assert runner_node(1, fake_sysfs).id == 1
    assert set(runner_cpus(2, fake_sysfs)) <= set(range(4))


def test_default_matrix_waives_device_pairs_without_gpu(fake_sysfs: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_copy, "gpu_count", lambda: 0)
    pairs, waived = plan_pairs(None, None, fake_sysfs)
    assert len(pairs) == 9 and Pair(Endpoint("host", 2), H0) in pairs
    assert ("host:2", "gpu:*") in waived and ("gpu:*", "host:1") in waived
    assert ("gpu:*", "gpu:*") in waived and len(waived) == 7
    pairs, waived = plan_pairs("host:2", None, fake_sysfs)
    assert [str(p.dst) for p in pairs] == ["host:0", "host:1", "host:2"]
    assert waived == [("host:2", "gpu:*")]
    assert plan_pairs("host:0", "host:1", fake_sysfs)[1] == []
    plan = _copy.make_plan("host:2", None, "1K", "both", fake_sysfs)
    recs = list(plan.waived("bandwidth", "bandwidth", {"threads": 1}))
    assert [(r.params["src"], r.params["dst"], r.params.get("memory"), r.status, r.reason)
            for r in recs] == [("host:2", "gpu:*", None, "waived", _copy.NO_GPU)] + [
        ("host:2", f"host:{n}", "pinned", "waived", "pinned memory needs CUDA "
         "(cudaHostRegister)") for n in range(3)]
    assert all(r.params["threads"] == 1 for r in recs)


def test_placement_verified_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    if libnuma() is None:
        pytest.skip("libnuma not available here")
    with HostBuffer(0, 4 << 20) as buf:
        assert buf.placement == "verified"
        assert ctypes.string_at(buf.ptr + (3 << 20), 4) == b"\x5a" * 4  # touched
    monkeypatch.setattr("kvbench.memory.libnuma", lambda: None)
    with HostBuffer(0, 1 << 20) as buf:
        assert buf.placement.startswith("unverified (libnuma unavailable")


@pytest.mark.parametrize("numa", [True, False])
def test_copy_buffers_are_not_laid_out_on_2m_boundaries(numa: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 11 item 3: Linux 6.7+ starts a mapping whose length is a multiple of 2 MiB on a
    2 MiB boundary, a layout whose 2-thread copies ran 8-10% under malloc'd buffers on the CI
    VM. Four buffers all on such a boundary by chance: 512**-4."""
    if numa and libnuma() is None:
        pytest.skip("libnuma not available here")
    if not numa:
        monkeypatch.setattr("kvbench.memory.libnuma", lambda: None)
    bufs = [HostBuffer(0, 4 << 20) for _ in range(4)]
    try:
        assert [b.ptr % (2 << 20) for b in bufs] != [0] * 4
        assert all(ctypes.string_at(b.ptr + (4 << 20) - 4, 4) == b"\x5a" * 4 for b in bufs)
    finally:
        for b in bufs:
            b.close()


@pytest.mark.parametrize("threads,size", [(1, 4096), (2, 4096), (2, 1000), (3, 64 << 10)])
def test_native_copy_moves_the_bytes(threads: int, size: int) -> None:
    c = HostCopier(Pair(H0, H0), "pageable", 1 << 20, threads, False)
    try:
        sb, db, _ = c.routes[0]
        pattern = bytes(range(256)) * (size // 256 + 1)
        ctypes.memmove(sb.ptr, pattern, size)
        ctypes.memset(db.ptr, 0, size + 64)
        assert c.sampler(size)(1) > 0
        assert ctypes.string_at(db.ptr, size) == pattern[:size]
        assert ctypes.string_at(db.ptr + size, 64) == b"\0" * 64  # nothing past the copy
    finally:
        c.close()


def test_coprime_hop_visits_every_window() -> None:
    for w in range(1, 60):
        hop = coprime_hop(w)
        assert {(i * hop) % w for i in range(w)} == set(range(w))


def test_time_native_keeps_returned_samples() -> None:
    vals = iter([9.0, 1.0, 2.0, 3.0])
    t = time_native(lambda: next(vals), Policy(warmup=1, min_reps=3, min_time_s=0, max_reps=3))
    assert t.seconds == (1.0, 2.0, 3.0) and t.timer.startswith("CLOCK_MONOTONIC")


def test_derived_sizes_interpolate_in_log2() -> None:
    sizes, gbs = [1024, 4096, 16384], [1.0, 2.0, 4.0]
    assert at_fraction(sizes, gbs, 0.9) == pytest.approx(2 ** 13.6)
    assert at_fraction(sizes, gbs, 0.5) == pytest.approx(4096)
    assert at_fraction(sizes, gbs, 0.2) == 1024
    recs = {r.metric: r for r in derived("bandwidth", sizes, gbs, {"src": "host:0"})}
    assert recs["peak_bandwidth"].value == 4.0
    assert recs["latency_floor"].value == pytest.approx(1024 / 1e9 * 1e6)
    assert all(r.provenance == "measured" and "derived" in r.method["derived"]
               for r in recs.values())


def test_bandwidth_sweep_writes_records_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "bw.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "4K,64K",
              "--threads", "2", "--quick", "--no-bars", "--out", str(out)])
    assert e.value.code == 0
    rs = load(out)
    bw = [r for r in rs.records if r["metric"] == "bandwidth" and r["status"] == "ok"]
    assert [r["params"]["size"] for r in bw] == [4096, 65536]
    for r in bw:
        assert r["unit"] == "GB/s" and r["value"] > 0 and len(r["samples"]) >= 3
        assert r["params"]["memory"] == "pageable" and r["params"]["threads"] == 2
        assert r["method"]["placement"] in ("verified", "node 0: unverified (libnuma "
                                            "unavailable: buffer not placed)")
    peak = next(r for r in rs.records if r["metric"] == "peak_bandwidth")
    assert peak["value"] == max(r["value"] for r in bw)
    assert (tmp_path / "bw" / "bandwidth.png").stat().st_size > 0


def test_bandwidth_memcpy_bar_record(tmp_path: Path) -> None:
    """The bar is one probe/reference ratio per interleaved round: its samples, median,
    per-side medians and pass flag agree with each other and with the bar it states."""
    out = tmp_path / "bar.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "4K",
              "--pageable", "--quick", "--out", str(out)])
    assert e.value.code == 0  # a bar that fails is a record, not a failed command
    bar = next(r for r in load(out).records if r["metric"] == "memcpy_ratio")
    assert bar["params"]["size"] == 256 << 20 and bar["params"]["reference"] == "kvb_memcpy_loop"
    m = bar["method"]
    assert len(bar["samples"]) == m["reps"] >= 3
    assert bar["value"] == statistics.median(bar["samples"])
    # both sides copy the same 256 MiB with glibc memcpy: within 3x of each other; a sample
    # is probe / reference bandwidth, and with every round's ratio in [lo, hi] the ratio of
    # the per-side medians (odd rounds) lies in [lo, hi] too
    medians = m["probe_gbps"] / m["reference_gbps"]
    assert 1 / 3 < medians < 3
    assert min(bar["samples"]) * (1 - 1e-9) <= medians <= max(bar["samples"]) * (1 + 1e-9)
    op, limit = m["bar"].split()
    assert op == ">=" and m["pass"] is (bar["value"] >= float(limit))


def test_pointer_chase_plausible() -> None:
    with ExitStack() as stack:
        got = LatencyProbe()._chase(0, 8 << 20, "/", stack)
        assert isinstance(got, tuple), got
        measure, record = got
        rec = record(measure(QUICK))
    assert rec.status == "ok" and rec.unit == "ns"
    assert 0.3 < rec.value < 10_000  # an L1 hit to a very slow remote miss


def test_latency_cli_small(tmp_path: Path) -> None:
    out = tmp_path / "lat.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["probe", "latency", "--src", "host:0", "--dst", "host:0", "--sizes", "1,4K",
              "--pageable", "--chase-size", "4M", "--quick", "--out", str(out)])
    assert e.value.code == 0
    recs = load(out).records
    lat = [r for r in recs if r["metric"] == "copy_latency"]
    assert [r["params"]["size"] for r in lat] == [1, 4096]
    assert all(r["value"] > 0 and r["unit"] == "us" for r in lat)
    assert lat[1]["value"] > lat[0]["value"]  # 4 KiB costs more than one byte
    assert [r["params"]["node"] for r in recs if r["metric"] == "load_latency"] == ["host:0"]
    # the chase and the copies were timed together, their samples spread over 8 passes
    for r in (r for r in recs if r["metric"] in ("copy_latency", "load_latency")):
        assert len(r["method"]["blocks"]) == 8 and sum(r["method"]["blocks"]) == len(r["samples"])
    assert (tmp_path / "lat" / "latency.png").is_file()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["pageable", "pinned"])
def test_gpu_copies_move_the_bytes(kind: str) -> None:
    """H2D, D2H and D2D both ways at once (two routes): the bandwidth-timed copies, the
    latency-timed ones and the bare torch loop each land their bytes. Every route's source
    holds its own pattern (no zero byte, distinct per offset and route), its destination
    zeros; read back after each kind of copy, every 64 KiB window of the destination is
    the source's same window or still all zero, and at least one window arrived (the torch
    loop: exactly the first). A copy that moved nothing, moved the wrong window or route,
    or tore a window fails; the timings are positive as well."""
    import torch

    from kvbench.probes._gpu_copy import GpuCopier

    g0, span, size = Endpoint("gpu", 0), 1 << 20, 1 << 16

    def fill(c: GpuCopier) -> None:
        for r, (src, dst) in enumerate(c.routes):
            pattern = (torch.arange(span) * (2 * r + 3) + 7 * r) % 250 + 1
            src.copy_(pattern.to(torch.uint8).to(src.device))
            dst.zero_()
        torch.cuda.synchronize()

    def arrived(c: GpuCopier) -> list[list[bool]]:
        """Per route, per window: whether it holds the source's bytes (else all zero)."""
        torch.cuda.synchronize()
        out = []
        for src, dst in c.routes:
            s, d = src.cpu().view(-1, size), dst.cpu().view(-1, size)
            done = (d == s).all(dim=1)
            assert bool((done | (d == 0).all(dim=1)).all()), "a window torn or misplaced"
            out.append(done.tolist())
        return out

    for pair in (Pair(H0, g0), Pair(g0, H0), Pair(g0, g0)):
        c = GpuCopier(pair, kind, span, bidirectional=pair.src == pair.dst)
        try:
            assert len(c.routes) == (2 if pair.src == pair.dst else 1)
            for latency in (False, True):
                fill(c)
                assert c.timing(size, QUICK, latency=latency).median > 0
                assert all(any(route) for route in arrived(c)), (pair, latency)
            fill(c)
            assert all(g > 0 for g in c.torch_loop_gbps(size, reps=2, rounds=2))
            first = arrived(c)[0]
            assert first[0] and not any(first[1:]), pair
        finally:
            c.close()


@pytest.mark.gpu
def test_gpu_pinned_sweep_records(tmp_path: Path) -> None:
    out = tmp_path / "gpu.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["probe", "bandwidth", "--src", "host:0", "--dst", "gpu:0", "--sizes", "64K,1M",
              "--quick", "--out", str(out)])
    assert e.value.code == 0
    recs = load(out).records
    kinds = {r["params"].get("memory") for r in recs if r["metric"] == "bandwidth"}
    assert kinds == {"pageable", "pinned"}
    assert any(r["metric"] == "pageable_pinned_ratio" for r in recs)
    assert any(r["metric"] == "torch_loop_ratio" for r in recs)


@pytest.mark.parametrize("size", [1, 63, 4097])
@pytest.mark.parametrize("fence", [0, 1])
def test_native_copy_jobs_at_unaligned_offsets(size: int, fence: int) -> None:
    """Issue 30: probes/copy.c's kvb_copy_jobs at odd addresses (source 3, destination 7
    bytes past a 64-byte line), odd sizes and a window stride of size + 5: three copies
    from window 1 stepping by 2 of 3 visit windows 1, 0, 2, each arriving byte for byte
    with the bytes between and after the windows untouched; `start` comes back as the next
    window (1). Two threads splitting a copy at an odd offset land their halves too."""
    import random

    from kvbench.native import CopyJob, lib

    so = lib()
    stride, windows = size + 5, 3
    total = stride * windows + 64
    src = (ctypes.c_char * (total + 128))()
    dst = (ctypes.c_char * (total + 128))()
    s0 = ctypes.addressof(src) // 64 * 64 + 64 + 3 - ctypes.addressof(src)
    d0 = ctypes.addressof(dst) // 64 * 64 + 64 + 7 - ctypes.addressof(dst)
    data = random.Random(size).randbytes(total)
    ctypes.memmove(ctypes.addressof(src) + s0, data, total)
    ctypes.memset(ctypes.addressof(dst), 0xEE, total + 128)
    job = CopyJob(ctypes.addressof(dst) + d0, ctypes.addressof(src) + s0, size, stride, windows,
                  2, 1, None, 0, fence, 0)
    jobs = (CopyJob * 1)(job)
    so.kvb_copy_jobs(jobs, 1, 3)  # its time may read 0 ns for 1 byte: the bytes decide
    assert jobs[0].start == 1 and jobs[0].allowed >= 1
    got = bytes(dst)[d0:d0 + total]
    expect = bytearray(b"\xee" * total)
    for w in range(windows):
        expect[w * stride:w * stride + size] = data[w * stride:w * stride + size]
    assert got == bytes(expect)
    assert bytes(dst)[:d0] == b"\xee" * d0  # nothing before the first window
    # two threads: [0, half) and [half, size) of window 0, half odd
    ctypes.memset(ctypes.addressof(dst), 0, total + 128)
    half = size // 2 | 1 if size > 2 else size
    parts = [(0, half), (half, size - half)]
    two = (CopyJob * 2)(*[CopyJob(ctypes.addressof(dst) + d0 + off, ctypes.addressof(src) + s0
                                  + off, n, stride, 1, 1, 0, None, 0, fence, 0)
                          for off, n in parts])
    so.kvb_copy_jobs(two, 2, 1)
    assert bytes(dst)[d0:d0 + size] == data[:size]
    assert bytes(dst)[d0 + size:] == b"\0" * (total + 128 - d0 - size)


@pytest.mark.parametrize("size", [1, 63, 4097])
def test_native_memcpy_references_at_unaligned_offsets(size: int) -> None:
    """The plain memcpy references (one thread, and 3 unpinned threads whose slices do not
    divide the size) move every byte at odd addresses, and nothing past it."""
    import random

    from kvbench.native import lib

    so = lib()
    data = random.Random(size + 1).randbytes(size)
    src = ctypes.create_string_buffer(b"\x11" + data, size + 64)  # data 1 byte in
    for threads in (1, 3):
        dst = ctypes.create_string_buffer(size + 64)
        if threads == 1:
            so.kvb_memcpy_loop(ctypes.addressof(dst) + 5, ctypes.addressof(src) + 1, size, 2)
            off = 5
        else:
            assert so.kvb_memcpy_threads(ctypes.addressof(dst) + 3, ctypes.addressof(src) + 1,
                                         size, 1, threads) > 0
            off = 3
        assert dst.raw[off:off + size] == data, threads
        assert dst.raw[:off] == b"\0" * off and dst.raw[off + size:] == b"\0" * (64 - off)


def test_copy_latency_record_is_microseconds_per_copy() -> None:
    """Issue 30: the latency probe's samples are seconds per copy x 1e6 (us), the value
    their median."""
    rec = LatencyProbe()._copy_record({"size": 64}, "verified", "one isolated copy")(
        Timing((2.5e-6, 1.25e-6, 5e-6, 4e-6), "CLOCK_MONOTONIC (native)", 1))
    assert rec.samples == pytest.approx([2.5, 1.25, 5.0, 4.0], rel=1e-12)
    assert rec.value == pytest.approx(3.25, rel=1e-12)
    assert (rec.unit, rec.direction, rec.metric) == ("us", "lower", "copy_latency")
