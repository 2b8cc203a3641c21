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


# --- the run counters' arithmetic, each figure computed by hand (issue 30) ---

def _series(c: Counters) -> dict[tuple[str, str, int], dict[int, float]]:
    return {(qn, w, layer): steps for qn, w, layer, steps in c.series()}


def test_attended_counts_tokens_flops_and_kv_bytes_by_hand() -> None:
    """q [B=2, Hq=6, Lq=3, D=8] over 10 keys, 2 KV heads of 2-byte elements: tokens
    B * n_kv = 20; FLOPs 4 B Hq Lq n_kv D = 4*2*6*3*10*8 = 11520; KV bytes
    2 B Hkv n_kv D elem = 2*2*2*10*8*2 = 1280; the query 2*6*3*8 * 2 bytes = 576."""
    import torch

    c = Counters(kv_heads=2, elem_bytes=2, n_layers=2)
    c.step, c.layer = 3, 1
    c.attended("accel", torch.zeros(2, 6, 3, 8), 10)
    s = _series(c)
    assert s[("tokens", "accel", 1)] == {3: 20.0}
    assert s[("flops", "accel", 1)] == {3: 11520.0}
    assert s[("bytes_read", "accel", 1)] == {3: 1280.0}
    (t,) = c.graph.tasks
    assert (t.step, t.layer, t.resource, t.op) == (3, 1, "accel", "attention")
    assert t.work == {"flops": 11520.0, "bytes_read": 1280.0 + 576, "bytes_written": 576.0,
                      "launches": 3}
    c.attention("disk", 1.0, 2.0, 3.0)  # not a resource: counted, no task
    assert len(c.graph.tasks) == 1 and _series(c)[("bytes_read", "disk", 1)] == {3: 3.0}


def test_add_scales_accumulates_and_settles_tensors_at_the_end() -> None:
    import torch

    c = Counters(kv_heads=1, elem_bytes=4, n_layers=1)
    c.step = 2
    c.add("flops", "accel", 10, scale=3.0)
    c.add("flops", "accel", 5)  # merges into the same compute task
    c.add("pages", "recalled", torch.tensor([1.0, 2.0, 4.0]), scale=2.0)
    c.add("bytes_read", "host", torch.tensor([[0.5, 0.5]]))
    c.add("time", "bookkeeping.x", 0.25)
    c.add("time", "attention", 9.0)  # a wait phase: no task
    c.step = 3
    c.add("flops", "accel", 1)
    s = _series(c)
    assert s[("flops", "accel", 0)] == {2: 35.0, 3: 1.0}
    assert s[("pages", "recalled", 0)] == {2: 14.0}
    assert s[("bytes_read", "host", 0)] == {2: 1.0}
    assert c.step_total("time", "bookkeeping.x", 2) == 0.25
    assert c.step_total("flops", "accel", 4) == 0.0
    ops = [(t.resource, t.op, t.work) for t in c.graph.tasks]
    assert ops == [("accel", "compute", {"flops": 35.0, "launches": 0.0}),
                   ("host", "compute", {"bytes_read": 1.0, "launches": 0.0}),
                   ("host", "bookkeeping.x", {"seconds": 0.25}),
                   ("accel", "compute", {"flops": 1.0, "launches": 0.0})]
    assert c.graph.tasks[2].background
    lazy_time = Counters(kv_heads=1, elem_bytes=4)
    lazy_time.add("time", "bookkeeping.y", torch.tensor([0.5, 0.25]), scale=2.0)
    lazy_time.settle()
    assert lazy_time.graph.tasks[0].work == {"seconds": 1.5}
    assert lazy_time.step_total("time", "bookkeeping.y", 0) == 1.5


def test_step_total_sums_layers_and_series_is_sorted() -> None:
    c = Counters(kv_heads=1, elem_bytes=4, n_layers=3)
    for layer, v in ((2, 1.0), (0, 2.0), (1, 4.0)):
        c.layer = layer
        c.add("tokens", "accel", v)
        c.add("tokens", "host", 100 * v)
    assert c.step_total("tokens", "accel", 0) == 7.0
    assert c.step_total("tokens", "host", 0) == 700.0
    keys = [(qn, w, layer) for qn, w, layer, _ in c.series()]
    assert keys == sorted(keys) and len(keys) == 6


def test_moved_counts_bytes_and_copies() -> None:
    c = Counters(kv_heads=1, elem_bytes=4, n_layers=2)
    c.step, c.layer = 1, 0
    c.moved("h2d", 4096.0, copies=4)
    c.moved("h2d", 1024.0)
    assert _series(c)[("bytes_moved", "h2d", 0)] == {1: 5120.0}
    a, b = c.graph.tasks
    assert (a.resource, a.op, a.work) == ("h2d", "copy", {"bytes_moved": 4096.0,
                                                          "copies": 4.0, "launches": 4.0})
    assert b.work == {"bytes_moved": 1024.0, "copies": 1.0, "launches": 1.0}


def test_dense_records_the_decoders_work_and_post_joins_forks() -> None:
    from kvbench.models import MODELS
    from kvbench.runtime.trace import dense_work

    spec = next(iter(MODELS.values()))
    c = Counters(kv_heads=1, elem_bytes=2, n_layers=1)
    c.step = 1
    with c.fork("side"):
        c.moved("h2d", 8.0)
    c.dense(spec, "post", 3)
    side, post = c.graph.tasks
    assert post.op == "post" and side.id in post.after
    assert post.work == dense_work(spec, "post", 3, 2)
    c.dense(spec, "pre", 1)
    assert c.graph.tasks[-1].after == [post.id]


def test_cpu_step_dispatch_is_wall_less_kernels_waits_and_carried(monkeypatch) -> None:
    """On the fake clock: a 100 ms step holding a 30 ms kernel, a 10 ms wait (wait=True), a
    15 ms carried block and a 5 ms attention block of a 4 ms kernel leaves 100 - 30 - 10
    - 15 - 4 = 41 ms of dispatch; a step whose waits exceed its wall time dispatches 0."""
    from kvbench.timing import kernel

    fake = FakeCuda().install(monkeypatch, context)
    ms = 1_000_000

    @kernel
    def matmul(ns: int) -> None:
        fake.host(ns)

    c = Counters(kv_heads=1, elem_bytes=4, n_layers=1)
    c.step = 1
    c.step_begin()
    matmul(30 * ms)
    with c.timed("bookkeeping.join", wait=True):
        fake.host(10 * ms)
    with c.timed("bookkeeping.y"):
        fake.host(15 * ms)
    with c.timed("attention"):
        matmul(4 * ms)
        fake.host(1 * ms)
    c.step_end(0.1)
    assert c.graph.tasks[-1].op == "dispatch"
    assert c.graph.tasks[-1].work["seconds"] == pytest.approx(0.041, rel=1e-12)
    assert c.step_total("time", "bookkeeping.join", 1) == pytest.approx(0.01, rel=1e-12)
    assert c.step_total("time", "attention", 1) == pytest.approx(0.005, rel=1e-12)
    carried = [t for t in c.graph.tasks if t.op == "bookkeeping.y"]
    assert carried[0].work == {"seconds": pytest.approx(0.015, rel=1e-12)}
    assert not [t for t in c.graph.tasks if t.op == "bookkeeping.join"]
    c.step = 2
    c.step_begin()
    with c.timed("accel_idle"):
        fake.host(50 * ms)
    c.step_end(0.02)
    assert c.graph.tasks[-1].work == {"seconds": 0.0}


def test_elem_bytes_is_the_dtypes_itemsize() -> None:
    import torch

    from kvbench.models import MODELS
    from kvbench.runtime.context import RunContext

    ctx = RunContext(spec=next(iter(MODELS.values())), n_layers=1, batch=1, max_len=8,
                     dtype=torch.bfloat16, accel=torch.device("cpu"),
                     host=torch.device("cpu"), counters=Counters(1, 2))
    assert ctx.elem_bytes == 2


def test_counters_accumulate_within_a_step_and_settle_in_float64(monkeypatch) -> None:
    import torch

    c = Counters(kv_heads=1, elem_bytes=4)
    assert c.graph.n_layers == 1
    c.attention("accel", 1.0, 2.0, 3.0)  # q_bytes 0 by default
    c.attention("accel", 10.0, 20.0, 30.0)
    c.add("tokens", "accel", 5)  # tokens make no task
    c.add("pages", "p", 2.0)
    c.add("pages", "p", torch.tensor([3.0]))  # a tensor adds to what the step holds
    c.add("pages", "big", torch.tensor([1e8, 1.0, -1e8]))  # float32 sums would lose the 1
    c.task("pnm", "score", flops=7.0)
    s = _series(c)
    assert s[("tokens", "accel", 0)] == {0: 16.0} and s[("flops", "accel", 0)] == {0: 22.0}
    assert s[("bytes_read", "accel", 0)] == {0: 33.0}
    assert s[("pages", "p", 0)] == {0: 5.0} and s[("pages", "big", 0)] == {0: 1.0}
    a, _, t = c.graph.tasks  # two attentions, the explicit task: tokens made none
    assert a.work == {"flops": 2.0, "bytes_read": 3.0, "bytes_written": 0.0, "launches": 3}
    assert (t.resource, t.op, t.work) == ("pnm", "score", {"flops": 7.0})


def test_step_end_without_step_begin_counts_from_zero(monkeypatch) -> None:
    monkeypatch.setattr(context, "kernel_ns", lambda: 0)
    c = Counters(kv_heads=1, elem_bytes=4)
    c.step_end(0.5)
    assert c.graph.tasks[-1].work == {"seconds": 0.5}


def test_cuda_times_of_one_phase_add_up_within_a_step(monkeypatch) -> None:
    fake = FakeCuda(launch_ns=0).install(monkeypatch, context)
    c = Counters(kv_heads=1, elem_bytes=2, cuda=True)
    c.step = 1
    for _ in range(2):
        with c.timed("attention"):
            fake.launch(10_000)
    fake.synchronize()
    c.step_end(1e-3)
    assert c.step_total("time", "attention", 1) == pytest.approx(20e-6, rel=1e-12)


def test_deferred_accounts_run_in_order_each_at_its_step() -> None:
    """after_step keeps an account with the step it was made in; flush (and settle, so
    step_end) runs them in the order given, each at its own step, and leaves the current
    step as it was; the elapsed seconds an account files land where the step ran, as a
    wait of the phase (no host task for "attention", one for another phase)."""
    c = Counters(kv_heads=1, elem_bytes=4, n_layers=1)
    ran: list[tuple[str, int]] = []
    c.step = 3
    c.after_step(lambda: (ran.append(("a", c.step)), c.elapsed("attention", 0.25)))
    c.step = 4
    c.after_step(lambda: (ran.append(("b", c.step)), c.elapsed("bookkeeping.x", 0.5)))
    c.step = 5
    assert not ran and not c.graph.tasks
    c.flush()
    assert ran == [("a", 3), ("b", 4)] and c.step == 5
    assert c.step_total("time", "attention", 3) == 0.25
    assert c.step_total("time", "bookkeeping.x", 4) == 0.5
    assert [(t.step, t.op, t.work) for t in c.graph.tasks] == [
        (4, "bookkeeping.x", {"seconds": 0.5})]
    c.flush()  # nothing left
    assert len(ran) == 2
    c.after_step(lambda: ran.append(("c", c.step)))
    c.step_end(0.0)  # settles: the account runs first
    assert ran[-1] == ("c", 5)


def test_an_undeclared_quantity_is_named() -> None:
    c = Counters(kv_heads=1, elem_bytes=4)
    with pytest.raises(ValueError, match="counted quantity 'pagez' is undeclared: add a "
                                         "Metric"):
        c.unit("pagez")
