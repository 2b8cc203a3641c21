"""The bytes bound's arithmetic on hand-built stage graphs (kvbench.runtime.bound): bytes per
step read per memory and moved per link, the bound of one memory or of several, the records
with every method field, the waived records without a bandwidth, and the probe taken again,
all with numbers worked out by hand (tests/test_step_bound.py runs them through real runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import Probes

from kvbench.runtime import bound


@dataclass
class Task:
    resource: str
    work: dict[str, float] = field(default_factory=dict)


@dataclass
class Graph:
    by_step: dict[int, list[Task]]

    def steps(self) -> dict[int, list[Task]]:
        return self.by_step


def bandwidth(shared: bool = True, **gbps: float) -> bound.Bandwidth:
    return bound.Bandwidth(dict(gbps), shared, "probe", {k: f"{k} by hand" for k in gbps})


GRAPH = Graph({
    1: [Task("accel", {"bytes_read": 4e9}), Task("accel", {"bytes_read": 2e9}),
        Task("host", {"bytes_read": 1e9}), Task("h2d", {"bytes_moved": 3e9}),
        Task("h2d", {"bytes_moved": 1e9}), Task("pnm", {"bytes_read": 5e8}),
        Task("d2h", {})],
    2: [Task("accel", {"bytes_read": 6e9}), Task("pnm_reduce", {"bytes_moved": 8.0})],
})


def test_step_bytes_sum_reads_per_memory_and_moves_per_link() -> None:
    per = bound.per_step(GRAPH, 3)
    assert per == [{"accel": 6e9, "host": 1e9, "h2d": 4e9, "pnm": 5e8},
                   {"accel": 6e9, "pnm_reduce": 8.0}, {}]


def test_bound_adds_terms_on_one_memory_and_overlaps_memories() -> None:
    nbytes = {"accel": 6e9, "host": 1e9, "h2d": 4e9, "h2d.recall": 2e9, "cxl": 7.0}
    # one memory (a CPU-only run): every term adds, the link's bytes too
    t, busy, unbounded = bound.bound(nbytes, bandwidth(accel=2.0, host=1.0, h2d=4.0))
    assert busy == pytest.approx({"host": 3.0 + 1.0 + 1.0 + 0.5})
    assert t == pytest.approx(5.5) and unbounded == {"cxl": 7.0}
    # a GPU's memory, the host's and each link in parallel: the busiest
    t, busy, _ = bound.bound(nbytes, bandwidth(False, accel=2.0, host=1.0, h2d=4.0))
    assert busy == pytest.approx({"accel": 3.0, "host": 1.0, "h2d": 1.5})
    assert t == pytest.approx(3.0)
    assert bound.bound({}, bandwidth(host=1.0)) == (0.0, {}, {})


def test_records_of_a_hand_built_graph() -> None:
    bw = bandwidth(False, accel=2.0, host=1.0, h2d=4.0)
    params = {"batch": 1}
    recs = {(r.metric, r.params.get("where")): r
            for r in bound.records("x", params, [2.0, 4.0], bound.per_step(GRAPH, 2), bw)}
    assert recs[("step_bytes", "accel")].samples == [6e9, 6e9]
    assert recs[("step_bytes", "h2d")].samples == [4e9, 0.0]
    assert recs[("step_bytes", "total")].samples == [11.5e9, 6e9 + 8.0]
    assert recs[("step_bytes", "total")].unit == "B"
    assert recs[("step_bytes", "total")].method == {"per": (
        "decode step: bytes its counters read from this memory or move over this link "
        "(counted, not timed); total: every memory and link")}
    b = recs[("step_bound_s", None)]
    assert (b.kind, b.name, b.unit, b.direction) == ("run", "x", "s", "none")
    assert b.params == params and b.samples == [3.0, 3.0] and b.value == 3.0
    m = b.method
    assert m["per"] == ("decode step: bytes read per memory and moved per link (the run's "
                        "counters) / measured GB/s; summed per memory, the largest memory's")
    assert m["statistic"] == "median" and m["bandwidth_source"] == "probe"
    assert m["gbps"] == bw.gbps and m["how"] == bw.how and m["one_memory"] is False
    assert m["bytes_per_step"] == {"accel": 6e9, "h2d": 2e9, "host": 5e8, "pnm": 2.5e8,
                                   "pnm_reduce": 4.0}
    # accel 3 s both steps; host (with the PNM role's reads) 1.5 s, then 0; h2d 1 s, then
    # 0: medians of the steps
    assert m["seconds_per_step"] == pytest.approx({"accel": 3.0, "host": 0.75, "h2d": 0.5})
    assert m["unbounded"] == {"pnm_reduce": 4.0}
    assert m["unbounded_note"] == "no measured bandwidth: these bytes are not in the bound"
    e = recs[("step_efficiency", None)]
    assert (e.unit, e.direction, e.params) == ("ratio", "higher", params)
    assert e.samples == pytest.approx([1.5, 0.75])
    assert e.method["statistic"] == "median" and e.method["bandwidth_source"] == "probe"
    assert e.method["step_bound_s"] == 3.0 and e.method["gbps"] == bw.gbps
    assert e.method["per"] == "decode step: its step_bound_s / its measured time (tbt)"


def test_records_without_a_bandwidth_say_why() -> None:
    recs = list(bound.records("x", {"batch": 2}, [1.0], bound.per_step(GRAPH, 1),
                              "bandwidth probe: none"))
    waived = [r for r in recs if r.metric != "step_bytes"]
    assert [(r.kind, r.name, r.metric, r.status, r.reason, r.params) for r in waived] == [
        ("run", "x", m, "waived", "bandwidth probe: none", {"batch": 2})
        for m in ("step_bound_s", "step_efficiency")]
    assert {r.params["where"] for r in recs if r.metric == "step_bytes"} == {
        "accel", "host", "h2d", "pnm", "total"}  # step 1 only


def test_steps_and_their_bytes_must_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller works out the steps' bytes (`per_step`); a list of another length than
    the steps' is refused, never zipped short."""
    two = [{"host": 3e9}, {"host": 3e9}]
    with pytest.raises(ValueError):
        list(bound.records("x", {}, [1.0], two, bandwidth(host=1.0)))
    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 10**9)
    Probes(monkeypatch, "read loop")([{"host": 1.0}, {"host": 9.0}])
    with pytest.raises(ValueError):
        bound.probe_bounding(False, 1, [1.0], two)


def test_probe_bounding_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 1 s reading 3 GB past a 1 GB cache: a probe of 1 GB/s bounds them at 3 s
    (efficiency 3), so the run probes again; 2 GB/s still gives 1.5; 4 GB/s bounds them."""
    graph = Graph({1: [Task("host", {"bytes_read": 3e9})]})
    fake = Probes(monkeypatch, "read loop")

    def calls() -> list[tuple[bool, int]]:
        return [(cuda, threads) for cuda, threads, _ in fake.calls]

    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 10**9)
    fake([{"host": 1.0, "h2d": 7.0}, {"host": 2.0}, {"host": 4.0, "h2d": 5.0}])
    bw = bound.probe_bounding(False, 3, [1.0], bound.per_step(graph, 1))
    assert calls() == [(False, 3)] * 3
    assert bw.gbps == {"host": 4.0, "h2d": 7.0}  # each quantity's highest; h2d kept first
    assert (bw.shared, bw.source) == (True, "probe")
    assert bw.how == {"host": "read loop; the highest of 3 probes (the first, 1 GB/s, "
                              "bounded the steps below their own rate)",
                      "h2d": "read loop; the highest of 3 probes (the first, 7 GB/s, "
                             "bounded the steps below their own rate)"}

    fake([{"host": 3.0}, {"host": 9.0}])  # exactly the steps' rate: the bound holds
    assert bound.probe_bounding(True, 1, [1.0], bound.per_step(graph, 1)).gbps == {"host": 3.0}
    assert calls() == [(True, 1)]

    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 1.5e9)  # 3 GB: twice the cache
    fake([{"host": 1.0}, {"host": 9.0}])
    assert bound.probe_bounding(False, 1, [1.0], bound.per_step(graph, 1)).gbps == {"host": 1.0}
    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 1.2e9)  # past twice the cache
    fake([{"host": 1.0}, {"host": 9.0}])
    assert bound.probe_bounding(False, 1, [1.0], bound.per_step(graph, 1)).gbps == {"host": 9.0}
    fake([{"host": 1.0}])
    assert bound.probe_bounding(False, 1, [], []).gbps == {"host": 1.0}  # no steps


class FakeLib:
    """The native library's read loop and memcpy, recording their arguments: 1 ns a byte
    read (1 GB/s), 0.5 ns a byte copied (2 GB/s)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def kvb_read_threads(self, ptr: int, n: int, iters: int, threads: int) -> int:
        self.calls.append(("read", (n, iters, threads)))
        return n

    def kvb_memcpy_threads(self, dst: int, src: int, n: int, iters: int, threads: int) -> int:
        self.calls.append(("memcpy", (dst - src, n, iters, threads)))
        return n // 2


def test_cpu_probe_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe on a CPU-only run: the read loop over `buffer_bytes`, a memcpy of half of it
    for both links (bytes counted once), the accelerator role the host's, each under
    PROBE_POLICY, and `how` naming sizes, threads and repetitions."""
    from kvbench import native, timing

    so = FakeLib()
    policies: list[object] = []

    def time_native(fn: Any, policy: object) -> Any:
        policies.append(policy)
        return timing.Timing((fn(),) * 3, "fake", 0)

    monkeypatch.setattr(native, "lib", lambda: so)
    monkeypatch.setattr(timing, "time_native", time_native)
    monkeypatch.setattr(bound, "buffer_bytes", lambda: 8 << 20)
    bw = bound.probe(False, 3)
    assert so.calls == [("read", (8 << 20, 1, 3)), ("memcpy", (4 << 20, 4 << 20, 1, 3))]
    assert policies == [bound.PROBE_POLICY] * 2
    assert bw.gbps == pytest.approx({"host": 1.0, "accel": 1.0, "h2d": 2.0, "d2h": 2.0})
    assert (bw.shared, bw.source) == (True, "probe")
    assert bw.how == {
        "host": "native read loop over 8 MiB on 3 threads, median of 3",
        "accel": "the host's (no GPU: the accelerator role is the CPU)",
        "h2d": "native memcpy of 4 MiB on 3 threads (bytes once), median of 3",
        "d2h": "as h2d"}


@pytest.mark.parametrize(("llc_mib", "want_mib"), [(1, 64), (20, 80), (100, 256)])
def test_probe_buffer_is_four_llcs_within_64_and_256_mib(
        monkeypatch: pytest.MonkeyPatch, llc_mib: int, want_mib: int) -> None:
    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: llc_mib << 20)
    assert bound.buffer_bytes() == want_mib << 20


def test_describe_names_each_term_and_the_source() -> None:
    from kvbench.units import format_bytes, format_seconds

    recs = list(bound.records("x", {}, [6.0], bound.per_step(Graph({1: [
        Task("host", {"bytes_read": 3e9}), Task("h2d.recall", {"bytes_moved": 1e9}),
        Task("cxl", {"bytes_moved": 5e8})]}), 1), bandwidth(host=1.5, h2d=2.0)))
    assert bound.describe(recs) == (
        f"bytes bound per decode step: cxl {format_bytes(5e8)} at (not bounded), h2d.recall "
        f"{format_bytes(1e9)} at 2 GB/s, host {format_bytes(3e9)} at 1.5 GB/s (probe, one "
        f"memory) = {format_seconds(2.5)}; step efficiency 0.42 of it")
    split = list(bound.records("x", {}, [6.0], [{"host": 3e9}], bandwidth(False, host=1.5)))
    assert bound.describe(split).endswith(f"(probe) = {format_seconds(2.0)}; step "
                                          "efficiency 0.33 of it")
    assert bound.describe([r for r in recs if r.metric != "step_efficiency"]) == ""
    unprobed = bound.records("x", {}, [1.0], bound.per_step(GRAPH, 1), "no probe")
    assert bound.describe(list(unprobed)) == ""


def test_stored_calibration(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """`--bandwidth calibration` reads this machine's stored calibration; its errors speak of
    that option; a calibration lacking a quantity names its file."""
    from kvbench.envinfo import collect_env
    from kvbench.errors import KvbenchError
    from kvbench.hwmodel import calibrate

    def rec(name: str, metric: str, value: float | None, **params: Any) -> dict:
        return {"name": name, "metric": metric, "value": value, "status": "ok",
                "params": params, "time": "t"}

    records = [rec("attention", "host_read_gbps", 12.0, bytes=256 << 20),
               rec("attention", "host_read_gbps", None, bytes=512 << 20),  # no value: skipped
               rec("attention", "host_read_gbps", 99.0),  # no size: the smallest
               *(rec("bandwidth", "bandwidth", 8.0, src=s, dst=d, memory="pageable",
                     size=1 << 28) for s, d in (("host:0", "host:0"),))]
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "stored", lambda: records)
    bw = bound.stored(False)
    assert bw == bound.from_calibration(records, False, "x")
    assert bw.gbps == {"host": 12.0, "accel": 12.0, "h2d": 8.0, "d2h": 8.0}
    where = tmp_path / "calibration" / calibrate.machine_key(collect_env()) / "probes.jsonl"
    with pytest.raises(KvbenchError) as e:
        bound.stored(True)
    assert str(e.value) == (f"--bandwidth calibration: the calibration in {where} has no "
                            "host:0 -> gpu:0 pinned bandwidth curve: rerun `kvbench calibrate`")
    monkeypatch.setenv("KVBENCH_CACHE", "off")
    with pytest.raises(KvbenchError, match=r"^--bandwidth calibration: KVBENCH_CACHE=off$"):
        bound.stored(False)

    def none() -> list[dict]:
        raise KvbenchError("--hardware this: no calibration of this machine (host h): run "
                           "`kvbench calibrate` (or pass --probes FILE)")
    monkeypatch.setattr(calibrate, "stored", none)
    with pytest.raises(KvbenchError) as e:
        bound.stored(False)
    assert str(e.value) == ("--bandwidth calibration: no calibration of this machine (host "
                            "h): run `kvbench calibrate`")


def test_calibration_on_a_gpu_machine() -> None:
    """With CUDA the links are the pinned torch curves to and from gpu:0 (another engine's,
    pageable ones or one that does not say, do not count) and the accelerator's memory the
    roofline's; each `how` names its probe, size and time."""
    def rec(name: str, metric: str, value: float, time: str | None = "t", **params: Any
            ) -> dict:
        return {"name": name, "metric": metric, "value": value, "status": "ok",
                "params": params, **({"time": time} if time else {})}

    curve = {"memory": "pinned", "size": 1 << 28}
    records = [rec("attention", "host_read_gbps", 12.0, bytes=256 << 20),
               rec("bandwidth", "bandwidth", 25.0, src="host:0", dst="gpu:0", **curve),
               rec("bandwidth", "bandwidth", 99.0, src="host:0", dst="gpu:0", engine="cupy",
                   **curve),
               rec("bandwidth", "bandwidth", 98.0, src="host:0", dst="gpu:0",
                   memory="pageable", size=1 << 29),
               rec("bandwidth", "bandwidth", 97.0, src="gpu:0", dst="gpu:0", **curve),
               rec("bandwidth", "bandwidth", 96.0, src="host:0", dst="gpu:0", size=1 << 30),
               rec("bandwidth", "bandwidth", 24.0, None, src="gpu:0", dst="host:0",
                   engine="torch", **curve),
               rec("roofline", "memory_gbps", 3000.0, bytes=1 << 30, device="cuda:0"),
               rec("roofline", "memory_gbps", 9000.0, bytes=1 << 31, device="cuda:1")]
    bw = bound.from_calibration(records, True, "p.jsonl")
    assert bw.gbps == {"host": 12.0, "h2d": 25.0, "d2h": 24.0, "accel": 3000.0}
    assert (bw.shared, bw.source) == (False, "calibration")
    assert bw.how == {
        "host": f"calibration: attention host_read_gbps at bytes {256 << 20} (t)",
        "h2d": f"calibration: bandwidth bandwidth at size {1 << 28} (t)",
        "d2h": f"calibration: bandwidth bandwidth at size {1 << 28} (time unknown)",
        "accel": f"calibration: roofline memory_gbps at bytes {1 << 30} (t)"}
    from kvbench.errors import KvbenchError

    with pytest.raises(KvbenchError, match="has no roofline memory_gbps on cuda:0: rerun"):
        bound.from_calibration(records[:-2], True, "p.jsonl")
    with pytest.raises(KvbenchError, match="has no attention host_read_gbps: rerun"):
        bound.from_calibration(records[1:], True, "p.jsonl")
    cpu = bound.from_calibration(
        [records[0], rec("bandwidth", "bandwidth", 8.0, src="host:0", dst="host:0",
                         memory="pageable", size=1)], False, "p.jsonl")
    assert cpu.how["accel"] == "the host's (no GPU: the accelerator role is the CPU)"


def test_describe_of_the_pnm_role_and_of_a_step_without_bytes() -> None:
    from kvbench.units import format_bytes, format_seconds

    recs = list(bound.records("x", {}, [1.0], [{"pnm": 2e9}], bandwidth(host=4.0)))
    assert bound.describe(recs).startswith(f"bytes bound per decode step: pnm "
                                           f"{format_bytes(2e9)} at 4 GB/s (probe, one memory)")
    empty = list(bound.records("x", {}, [1.0], [{}], bandwidth(host=4.0)))
    assert bound.describe(empty) == (f"bytes bound per decode step:  (probe, one memory) = "
                                     f"{format_seconds(0)}; step efficiency 0.00 of it")
