"""`kvbench probe bandwidth --engine cupy` (kvbench.probes._cupy) on the CPU, against a fake
`cupy` module: the runtime calls the raw-CUDA reference makes (pointers, sizes, copy kinds,
streams, events), and the bytes and GB/s of its records, exactly; a one-line error where
cupy is missing."""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_usage_error, cli

from kvbench.memory import Endpoint
from kvbench.probes import _copy
from kvbench.probes._copy import Pair
from kvbench.probes._cupy import CupyCopier
from kvbench.probes._gpu_copy import _SLEEP_CYCLES
from kvbench.probes.bandwidth import BandwidthConfig, BandwidthProbe
from kvbench.timing import Policy

MAIN = 0x55  # torch's current stream, as a cudaStream_t
MS = 0.25  # what every cudaEventElapsedTime returns


class FakeRuntime:
    """cupy.cuda.runtime: the constants of cupy_backends' runtime.pxd, calls recorded."""

    memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 1, 2, 3
    streamNonBlocking = 1
    eventDisableTiming = 2

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._next = {"malloc": 0x7000_0000_0000, "stream": 0x100, "event": 0x200}

    def _new(self, kind: str, step: int) -> int:
        self._next[kind] += step
        return self._next[kind]

    def __getattr__(self, name: str) -> Any:  # calls without a result
        return lambda *args: self.calls.append((name, *args))

    def malloc(self, size: int) -> int:
        self.calls.append(("malloc", size))
        return self._new("malloc", 1 << 32)

    def streamCreateWithFlags(self, flags: int) -> int:
        self.calls.append(("streamCreateWithFlags", flags))
        return self._new("stream", 1)

    def eventCreate(self) -> int:
        self.calls.append(("eventCreate",))
        return self._new("event", 1)

    def eventCreateWithFlags(self, flags: int) -> int:
        self.calls.append(("eventCreateWithFlags", flags))
        return self._new("event", 1)

    def eventElapsedTime(self, start: int, end: int) -> float:
        self.calls.append(("eventElapsedTime", start, end))
        return MS


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    """A fake cupy, and torch.cuda's device context (recorded as a call), current stream
    and _sleep on the CPU."""
    fake = FakeRuntime()
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=fake)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    def device(index: int) -> contextlib.AbstractContextManager[None]:
        fake.calls.append(("device", index))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda index: types.SimpleNamespace(cuda_stream=MAIN))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: fake.calls.append(("sleep", cycles)))
    monkeypatch.setattr(_copy, "gpu_count", lambda: 1)
    return fake


H2D = Pair(Endpoint("host", 0), Endpoint("gpu", 0))
SPAN = 1 << 20
POLICY = Policy(warmup=1, min_reps=3, min_time_s=0.0, max_reps=3)


def test_h2d_pinned_copies_and_events(rt: FakeRuntime) -> None:
    c = CupyCopier(H2D, "pinned", SPAN, False)
    (host,) = c.buffers
    dev = c.device_ptrs[0]
    e0, e1, _fork = c.events
    assert rt.calls == [("device", 0), ("hostRegister", host.ptr, SPAN, 0), ("device", 0),
                        ("malloc", SPAN), ("eventCreate",), ("eventCreate",),
                        ("eventCreateWithFlags", 2)]
    assert c.routes == [(host.ptr, dev, 1)] and c.streams == []
    rt.calls.clear()
    t = c.timing(4096, POLICY)
    copy = [("memcpyAsync", dev + off, host.ptr + off, 4096, 1, MAIN)
            for off in (0, 4096, 8192, 12288)]  # the warm-up, then the next windows
    sample = [("sleep", _SLEEP_CYCLES), ("eventRecord", e0, MAIN), None,
              ("eventRecord", e1, MAIN), ("eventSynchronize", e1), ("eventElapsedTime", e0, e1)]
    want = [("device", 0), copy[0], ("streamSynchronize", MAIN)]
    for k in (1, 2, 3):
        want += [x or copy[k] for x in sample]
    assert rt.calls == want
    assert t.seconds == (MS * 1e-3,) * 3 and t.warmup == 1 and "cupy" in t.timer
    rt.calls.clear()
    events, ptr = list(c.events), host.ptr
    c.close()
    assert rt.calls == [("eventDestroy", e) for e in events] + [("hostUnregister", ptr),
                                                                ("free", dev)]
    assert c.buffers == [] and c.events == []


def test_d2h_pageable_registers_nothing(rt: FakeRuntime) -> None:
    c = CupyCopier(Pair(Endpoint("gpu", 0), Endpoint("host", 0)), "pageable", SPAN, False)
    assert not any(call[0] == "hostRegister" for call in rt.calls)
    assert c.routes == [(c.device_ptrs[0], c.buffers[0].ptr, 2)]
    c.close()


def test_d2d_allocates_each_buffer_on_its_gpu(rt: FakeRuntime) -> None:
    c = CupyCopier(Pair(Endpoint("gpu", 1), Endpoint("gpu", 0)), "device", SPAN, False)
    assert rt.calls[:5] == [("device", 0), ("device", 1), ("malloc", SPAN), ("device", 0),
                            ("malloc", SPAN)]
    assert c.routes == [(*c.device_ptrs, 3)] and c.buffers == []
    assert c.placement == "device memory"
    c.close()


def test_bidirectional_forks_the_reverse_route_onto_its_own_stream(rt: FakeRuntime) -> None:
    c = CupyCopier(H2D, "pinned", SPAN, True)
    (fwd_src, fwd_dst, k1), (rev_src, rev_dst, k2) = c.routes
    assert (k1, k2) == (1, 2) and (rev_src, rev_dst) == (c.device_ptrs[1], c.buffers[1].ptr)
    (side,) = c.streams
    fork, join = c.events[2:]
    assert ("streamCreateWithFlags", 1) in rt.calls
    rt.calls.clear()
    c._copy(SPAN // 2, MAIN)
    assert rt.calls == [("eventRecord", fork, MAIN), ("streamWaitEvent", side, fork, 0),
                        ("memcpyAsync", fwd_dst, fwd_src, SPAN // 2, 1, MAIN),
                        ("memcpyAsync", rev_dst, rev_src, SPAN // 2, 2, side),
                        ("eventRecord", join, side), ("streamWaitEvent", MAIN, join, 0)]
    assert c.bytes_per_copy(4096) == 8192
    c.close()
    assert ("streamDestroy", side) in rt.calls


def test_probe_records_engine_bytes_and_gbps(rt: FakeRuntime) -> None:
    """The probe's records through the cupy engine: GB/s = bytes / (elapsed ms * 1e-3) / 1e9
    for every sample, engine in params and method, and the torch-only GPU bars waived."""
    cfg = BandwidthConfig(src="host:0", dst="gpu:0", memory="pinned", sizes="4K,1M",
                          quick=True, engine="cupy")
    recs = list(BandwidthProbe().run(cfg))
    bw = [r for r in recs if r.metric == "bandwidth"]
    assert [r.params["size"] for r in bw] == [4096, 1 << 20]
    for r in bw:
        assert r.samples == [r.params["size"] / (MS * 1e-3) / 1e9] * 3
        assert r.params["engine"] == "cupy" and r.method["engine"] == "cupy"
        assert r.method["timer"].startswith("cuda_event (cudaEventElapsedTime")
    bars = {r.metric: r for r in recs if r.metric in ("torch_loop_ratio", "pcie_link_ratio")}
    assert {r.status for r in bars.values()} == {"waived"} and len(bars) == 2
    assert "--engine torch" in bars["pcie_link_ratio"].reason


def test_engine_is_validated_and_missing_cupy_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bw.jsonl"
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    for engine, words in (("cupy", "needs cupy"), ("numba", "--engine 'numba'")):
        assert_usage_error(cli(["probe", "bandwidth", "--src", "host:0", "--dst", "host:0",
                                "--sizes", "4K", "--engine", engine, "--out", str(out)],
                               capsys), words)
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["pageable", "pinned"])
def test_cupy_engine_moves_the_bytes_on_a_gpu(kind: str) -> None:
    """On a GPU with cupy, bidirectional: one _copy moves a pattern H2D on the main stream
    and, on the reverse route's own stream, D2H from the second device buffer (filled
    first); both arrive intact, and a quick sweep's records are ok."""
    import ctypes

    pytest.importorskip("cupy")
    c = CupyCopier(H2D, kind, SPAN, True)
    try:
        (src, dev, _), (dev2, back, _) = c.routes
        pattern = bytes(range(256)) * 16
        ctypes.memmove(src, pattern, len(pattern))
        c.rt.memcpy(dev2, src, len(pattern), c.rt.memcpyHostToDevice)
        c._copy(len(pattern), c._main())
        c.rt.streamSynchronize(c._main())
        assert ctypes.string_at(back, len(pattern)) == pattern  # the D2H route
        got = ctypes.create_string_buffer(len(pattern))
        c.rt.memcpy(ctypes.addressof(got), dev, len(pattern), c.rt.memcpyDeviceToHost)
        assert got.raw == pattern  # the H2D route
        assert c.timing(1 << 16, POLICY).median > 0
        assert c.timing(1 << 10, POLICY, latency=True).median > 0
    finally:
        c.close()
    cfg = BandwidthConfig(src="host:0", dst="gpu:0", memory=kind, sizes="64K,1M", quick=True,
                          engine="cupy")
    bw = [r for r in BandwidthProbe().run(cfg) if r.metric == "bandwidth"]
    assert [r.status for r in bw] == ["ok", "ok"] and all(r.value > 0 for r in bw)
