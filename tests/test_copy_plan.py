"""The copy probes' plumbing (kvbench/probes/_copy.py) that no CPU sweep reaches on its own
(issue 30): which copier a pair gets and with what buffers, the C memcpy reference per
thread count, and the records waived for pairs and memory kinds this machine cannot run."""

from __future__ import annotations

import ctypes

import pytest

from kvbench.memory import Endpoint
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
