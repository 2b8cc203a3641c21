"""The bytes bound's arithmetic on hand-built stage graphs (kvbench.runtime.bound): bytes per
step read per memory and moved per link, the bound of one memory or of several, the records
with every method field, the waived records without a bandwidth, and the probe taken again,
all with numbers worked out by hand (tests/test_step_bound.py runs them through real runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

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
            for r in bound.records("x", params, [2.0, 4.0], GRAPH, bw)}
    assert recs[("step_bytes", "accel")].samples == [6e9, 6e9]
    assert recs[("step_bytes", "h2d")].samples == [4e9, 0.0]
    assert recs[("step_bytes", "total")].samples == [11.5e9, 6e9 + 8.0]
    assert recs[("step_bytes", "total")].unit == "B"
    assert "counted, not timed" in recs[("step_bytes", "total")].method["per"]
    b = recs[("step_bound_s", None)]
    assert (b.kind, b.name, b.unit, b.direction) == ("run", "x", "s", "none")
    assert b.params == params and b.samples == [3.0, 3.0] and b.value == 3.0
    m = b.method
    assert m["statistic"] == "median" and m["bandwidth_source"] == "probe"
    assert m["gbps"] == bw.gbps and m["how"] == bw.how and m["one_memory"] is False
    assert m["bytes_per_step"] == {"accel": 6e9, "h2d": 2e9, "host": 5e8, "pnm": 2.5e8,
                                   "pnm_reduce": 4.0}
    # accel 3 s both steps; host (with the PNM role's reads) 1.5 s, then 0; h2d 1 s, then
    # 0: medians of the steps
    assert m["seconds_per_step"] == pytest.approx({"accel": 3.0, "host": 0.75, "h2d": 0.5})
    assert m["unbounded"] == {"pnm_reduce": 4.0}
    assert "not in the bound" in m["unbounded_note"]
    e = recs[("step_efficiency", None)]
    assert (e.unit, e.direction, e.params) == ("ratio", "higher", params)
    assert e.samples == pytest.approx([1.5, 0.75])
    assert e.method["statistic"] == "median" and e.method["bandwidth_source"] == "probe"
    assert e.method["step_bound_s"] == 3.0 and e.method["gbps"] == bw.gbps
    assert "measured time" in e.method["per"]


def test_records_without_a_bandwidth_say_why() -> None:
    recs = list(bound.records("x", {"batch": 2}, [1.0], GRAPH, "bandwidth probe: none"))
    waived = [r for r in recs if r.metric != "step_bytes"]
    assert [(r.kind, r.name, r.metric, r.status, r.reason, r.params) for r in waived] == [
        ("run", "x", m, "waived", "bandwidth probe: none", {"batch": 2})
        for m in ("step_bound_s", "step_efficiency")]
    assert {r.params["where"] for r in recs if r.metric == "step_bytes"} == {
        "accel", "host", "h2d", "pnm", "total"}  # step 1 only


def test_probe_bounding_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 1 s reading 3 GB past a 1 GB cache: a probe of 1 GB/s bounds them at 3 s
    (efficiency 3), so the run probes again; 2 GB/s still gives 1.5; 4 GB/s bounds them."""
    graph = Graph({1: [Task("host", {"bytes_read": 3e9})]})
    calls: list[tuple[bool, int]] = []

    def fake(readings: list[dict[str, float]]) -> None:
        it = iter(readings)

        def probe(cuda: bool, threads: int) -> bound.Bandwidth:
            calls.append((cuda, threads))
            return bound.Bandwidth(next(it), True, "probe", {"host": "read loop"})
        calls.clear()
        monkeypatch.setattr(bound, "probe", probe)

    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 10**9)
    fake([{"host": 1.0, "h2d": 7.0}, {"host": 2.0}, {"host": 4.0, "h2d": 5.0}])
    bw = bound.probe_bounding(False, 3, [1.0], graph)
    assert calls == [(False, 3)] * 3
    assert bw.gbps == {"host": 4.0, "h2d": 7.0}  # each quantity's highest; h2d kept first
    assert (bw.shared, bw.source) == (True, "probe")
    assert bw.how == {"host": "read loop; the highest of 3 probes (the first, 1 GB/s, "
                              "bounded the steps below their own rate)"}

    fake([{"host": 3.0}, {"host": 9.0}])  # exactly the steps' rate: the bound holds
    assert bound.probe_bounding(True, 1, [1.0], graph).gbps == {"host": 3.0}
    assert calls == [(True, 1)]

    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 1.5e9)  # 3 GB: twice the cache
    fake([{"host": 1.0}, {"host": 9.0}])
    assert bound.probe_bounding(False, 1, [1.0], graph).gbps == {"host": 1.0}
    monkeypatch.setattr("kvbench.memory.llc_bytes", lambda: 1.2e9)  # past twice the cache
    fake([{"host": 1.0}, {"host": 9.0}])
    assert bound.probe_bounding(False, 1, [1.0], graph).gbps == {"host": 9.0}
    fake([{"host": 1.0}])
    assert bound.probe_bounding(False, 1, [], graph).gbps == {"host": 1.0}  # no steps
