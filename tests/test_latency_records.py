"""`kvbench probe latency`'s records exactly (issue 30): every timing replaced by a known one,
so each record's unit, scale, params and method are checked against numbers written here;
the chase buffer's size rule; a chase that cannot be built."""

from __future__ import annotations

import pytest

from kvbench.memory import runner_cpus
from kvbench.probes import _copy, latency
from kvbench.probes.latency import LatencyConfig, LatencyProbe, chase_bytes
from kvbench.timing import DEFAULT, PASSES, QUICK, Policy, Timing

SECONDS = (2e-9, 3e-9, 4e-9)


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every chase and copy measured as SECONDS; returns (what, size, latency, policy) per
    call: 'chase' for a node's pointer chase, 'copy' for a copier's measure."""
    calls: list[tuple] = []

    def fake(what: str, size: int, lat: bool | None):
        def measure(policy: Policy) -> Timing:
            calls.append((what, size, lat, policy))
            return Timing(SECONDS, "fake", policy.warmup)
        return measure

    monkeypatch.setattr(latency, "calibrated", lambda sample: fake("chase", 0, None))
    monkeypatch.setattr(_copy.HostCopier, "measure",
                        lambda self, size, latency=False: fake("copy", size, latency))
    return calls


@pytest.mark.parametrize("quick", [True, False])
def test_records_carry_the_timings_in_their_units(timed: list[tuple], quick: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[tuple] = []
    real_open, real_buffer = latency.open_copier, latency.HostBuffer
    monkeypatch.setattr(latency, "open_copier",
                        lambda *args: opened.append(args) or real_open(*args))
    monkeypatch.setattr(latency, "HostBuffer", lambda node, size, **kw: opened.append(
        ("buffer", node, size, kw)) or real_buffer(node, size, **kw))
    config = LatencyConfig(src="host:0", dst="host:0", sizes="1,64", memory="both",
                           chase_size="64K", quick=quick)
    recs = list(LatencyProbe().run(config))
    # the chase buffer with huge pages advised; one copier per pair and memory kind, one
    # thread, one way, buffers for the largest size
    pair = _copy.Pair(latency.Endpoint("host", 0), latency.Endpoint("host", 0))
    assert opened == [("buffer", 0, 65536, {"hugepages": True}),
                      (pair, "pageable", 64, 1, False, "/")]
    waived, chase, *copies = recs
    assert (waived.kind, waived.name, waived.metric, waived.status, waived.params) == (
        "probe", "latency", "copy_latency", "waived",
        {"src": "host:0", "dst": "host:0", "memory": "pinned"})  # pinned needs CUDA here
    ns = [x * 1e9 for x in SECONDS] * PASSES
    assert (chase.kind, chase.name, chase.metric, chase.unit, chase.direction) == (
        "probe", "latency", "load_latency", "ns", "lower")
    assert chase.params == {"node": "host:0", "size": 65536}
    assert chase.samples == pytest.approx(ns, rel=1e-12) and chase.value == pytest.approx(3.0)
    cpus = runner_cpus(0, "/")
    assert {k: chase.method[k] for k in ("cpu", "runner_node", "per")} == {
        "cpu": cpus[0], "runner_node": 0, "per": "dependent load over a random cyclic "
        "permutation of 64-byte lines (transparent huge pages advised)"}
    assert chase.method["placement"] and chase.method["timer"] == "fake"
    assert [(r.name, r.metric, r.unit, r.direction, r.params) for r in copies] == [
        ("latency", "copy_latency", "us", "lower",
         {"src": "host:0", "dst": "host:0", "direction": "h2h", "memory": "pageable", "size": s})
        for s in (1, 64)]
    for r in copies:
        assert r.samples == pytest.approx([x * 1e6 for x in SECONDS] * PASSES, rel=1e-12)
        assert r.method["per"] == "one isolated copy" and r.method["placement"]
    # each quantity in every pass, the copies at latency (one fenced thread), the policy's
    # share of the run's
    policy = (QUICK if quick else DEFAULT).share(PASSES)
    assert sorted((w, s, lat) for w, s, lat, _ in timed) == sorted(
        [("chase", 0, None)] * PASSES + [("copy", 1, True)] * PASSES
        + [("copy", 64, True)] * PASSES)
    assert {p.warmup for *_, p in timed} == {policy.warmup, 0}
    assert {(p.min_reps, p.max_reps, p.max_time_s) for *_, p in timed} == {
        (policy.min_reps, policy.max_reps, policy.max_time_s)}


def test_a_chase_sample_is_nanoseconds_per_load_in_steps_of_8(monkeypatch) -> None:
    """sample(iters): at least 64 dependent loads, rounded up to the C loop's 8 per step,
    on the runner CPU; the native nanoseconds over the loads."""
    from kvbench import native

    real = native.lib()
    loads: list[tuple[int, int]] = []

    class So:
        def __getattr__(self, name: str):
            return getattr(real, name)

        def kvb_chase(self, cursor: object, n: int, cpu: int) -> int:
            loads.append((n, cpu))
            return 1000 * n

    monkeypatch.setattr(native, "lib", lambda: So())
    samples: list = []
    monkeypatch.setattr(latency, "calibrated", lambda sample: samples.append(sample) or (
        lambda policy: Timing(SECONDS, "fake", 0)))
    config = LatencyConfig(src="host:0", dst="host:0", sizes="1", memory="pageable",
                           chase_size="64K", quick=True)
    list(LatencyProbe().run(config))
    (sample,) = samples
    assert [sample(n) for n in (1, 64, 65, 100, 104)] == pytest.approx([1e-6] * 5)
    cpu = runner_cpus(0, "/")[0]
    assert loads == [(64, cpu), (64, cpu), (72, cpu), (104, cpu), (104, cpu)]


def test_a_chase_that_cannot_be_built_is_an_error_record(timed, monkeypatch) -> None:
    from kvbench import native

    real = native.lib()

    class So:
        def __getattr__(self, name: str):
            return getattr(real, name)

        def kvb_chase_build(self, *args: object) -> int:
            return 1

    monkeypatch.setattr(native, "lib", lambda: So())
    config = LatencyConfig(src="host:0", dst="host:0", sizes="1", memory="pageable",
                           chase_size="64K", quick=True)
    chase = next(r for r in LatencyProbe().run(config) if r.metric == "load_latency")
    assert (chase.kind, chase.name, chase.status, chase.reason, chase.params) == (
        "probe", "latency", "error", "out of memory building the chase",
        {"node": "host:0", "size": 65536})


def test_chase_buffer_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """--chase-size rounded down to whole 64-byte lines, at least 2; else 4 x LLC of the
    configured root, at least 64 MiB."""
    assert chase_bytes(LatencyConfig(chase_size="1K")) == 1024
    assert chase_bytes(LatencyConfig(chase_size="200")) == 192
    assert chase_bytes(LatencyConfig(chase_size="10")) == 128
    roots: list[object] = []
    monkeypatch.setattr(latency, "llc_bytes", lambda root: roots.append(root) or llc[0])
    llc = [32 << 20]
    assert chase_bytes(LatencyConfig(root="/sys-fake")) == 128 << 20
    llc = [1 << 20]
    assert chase_bytes(LatencyConfig()) == 64 << 20
    assert roots == ["/sys-fake", "/"]
