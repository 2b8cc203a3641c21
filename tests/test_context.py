"""runtime.context.Counters on CUDA, through the CUDA-shaped fake (tests/fake_cuda.py)."""

from __future__ import annotations

import gc

import pytest
from fake_cuda import FakeCuda

import kvbench.runtime.context as context
from kvbench.runtime.context import HOST_PHASES, Counters


def test_cuda_phase_events_are_pooled_and_resolved_at_step_end(monkeypatch) -> None:
    """Audit finding 11: 2 layers x 2 device phases hold 4 event pairs within a step;
    step_end resolves them and returns them to the pool, so 100 steps make the 8 events of
    the first, and each step's seconds are there at its end: the first kernel of a step waits
    for its 5 us launch on an idle device (35 us), the later ones queue behind their
    predecessors (30 and 10 us: device time only)."""
    fake = FakeCuda(launch_ns=5_000).install(monkeypatch, context)
    c = Counters(kv_heads=1, elem_bytes=2, cuda=True, n_layers=2)
    for step in range(1, 101):
        c.step = step
        c.step_begin()
        for layer in range(2):
            c.layer = layer
            with c.timed("attention"):
                fake.launch(30_000)
            with c.timed("bookkeeping.scores"):
                fake.launch(10_000)
        fake.synchronize()  # as decode_run does before step_end
        c.step_end(1e-3)
        assert fake.made == 8
        assert c.step_total("time", "attention", step) == pytest.approx(65e-6, rel=1e-12)
        assert c.step_total("time", "bookkeeping.scores", step) == pytest.approx(20e-6,
                                                                                 rel=1e-12)
    gc.collect()
    assert len(fake.live) == 8
    carried = [t for t in c.graph.tasks if t.op == "bookkeeping.scores"]
    assert len(carried) == 200
    assert [t.work["seconds"] for t in carried] == pytest.approx([10e-6] * 200, rel=1e-12)


def test_host_phases_on_cuda_use_the_host_clock(monkeypatch) -> None:
    """A host phase (issuing work, joining a worker) on CUDA is its host time: 5 us to
    launch, not the 100 us its kernel then takes on the stream; it makes no events."""
    assert {"bookkeeping.issue", "bookkeeping.handoff", "pnm.attention"} <= HOST_PHASES
    fake = FakeCuda(launch_ns=5_000).install(monkeypatch, context)
    c = Counters(kv_heads=1, elem_bytes=2, cuda=True, n_layers=1)
    c.step = 1
    c.step_begin()
    with c.timed("bookkeeping.issue"):
        fake.launch(100_000)
    with c.timed("bookkeeping.handoff", wait=True):
        fake.host(40_000)
    fake.synchronize()
    c.step_end(1e-3)
    assert fake.made == 0
    assert c.step_total("time", "bookkeeping.issue", 1) == pytest.approx(5e-6, rel=1e-12)
    assert c.step_total("time", "bookkeeping.handoff", 1) == pytest.approx(40e-6, rel=1e-12)
    (task,) = [t for t in c.graph.tasks if t.op == "bookkeeping.issue"]
    assert task.resource == "host" and task.work["seconds"] == pytest.approx(5e-6, rel=1e-12)


@pytest.mark.gpu
def test_cuda_counters_reuse_real_events() -> None:
    import torch

    c = Counters(kv_heads=1, elem_bytes=2, cuda=True, n_layers=1)
    a = torch.ones(1 << 20, device="cuda")
    for step in range(1, 4):
        c.step = step
        c.step_begin()
        with c.timed("attention"):
            a.mul_(1.0)
        torch.cuda.synchronize()
        c.step_end(0.0)
        assert c.step_total("time", "attention", step) > 0
        assert len(c._pairs) == 1
