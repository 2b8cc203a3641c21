"""The attention probe's parts one by one (issue 30): the grid and its bad input, the memory
groups the passes run over, the copies the bars divide by and their records, what each mode
times, and every bar with its verdict at the limit. Timers and memory sizes are fakes, so each
number is checked against the arithmetic written here; the CUDA branches run with fakes too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import drain

from kvbench.errors import KvbenchError
from kvbench.kernels.workload import Point
from kvbench.probes import attention
from kvbench.probes.attention import (
    BIG_KV,
    COPY_BYTES,
    DEVICE_COPY_BYTES,
    MODES,
    AttentionConfig,
    AttentionProbe,
    _groups,
    grid,
    modes,
)
from kvbench.timing import Policy, Timing


def test_the_grid_is_every_combination_in_measuring_order() -> None:
    config = AttentionConfig(batch="1,2", heads="4", kv_heads="2", head_dim="8",
                             gpu_tokens="16,1K", host_tokens="64", query="1",
                             dtype="float32, bf16")
    want = [Point(b, 4, 2, 8, g, 64, 1, dt) for b in (1, 2) for g in (16, 1024)
            for dt in ("float32", "bfloat16")]
    assert grid(config) == want
    assert [p.dtype for p in want[:2]] == ["float32", "bfloat16"]


@pytest.mark.parametrize(("field", "text", "message"), [
    ("batch", "1,x", "cannot parse batch '1,x' (expected e.g. 1,4,8)"),
    ("heads", "4,0", "heads must be positive, got '4,0'"),
    ("kv_heads", "-2", "kv heads must be positive, got '-2'"),
    ("head_dim", "0", "head dim must be positive, got '0'"),
    ("query", "q", "cannot parse query length 'q' (expected e.g. 1,4,8)"),
    ("kv_heads", "3", "heads (32) must be a multiple of kv heads (3)"),
])
def test_a_bad_grid_value_is_named(field: str, text: str, message: str) -> None:
    with pytest.raises(KvbenchError) as e:
        grid(AttentionConfig(**{field: text}))
    assert str(e.value) == message


def test_modes_all_a_list_and_the_refusals() -> None:
    assert modes(AttentionConfig(), cuda=False) == list(MODES)
    assert modes(AttentionConfig(modes=" hybrid,cpu-dense "), cuda=False) == ["hybrid",
                                                                             "cpu-dense"]
    assert modes(AttentionConfig(modes="gpu"), cuda=True) == ["gpu"]
    with pytest.raises(KvbenchError) as e:
        modes(AttentionConfig(modes="cpu-dense,gpux"), cuda=True)
    assert str(e.value) == ("unknown mode 'gpux' (known: gpu, gpu-transfer, cpu-dense, "
                            "cpu-sparse, hybrid, all)")
    with pytest.raises(KvbenchError) as e:
        modes(AttentionConfig(modes="gpu-transfer"), cuda=False)
    assert str(e.value) == "mode 'gpu-transfer' needs a CUDA GPU and there is none"


def _point(gpu: int, host: int) -> Point:
    return Point(1, 1, 1, 1, gpu, host, 1, "float32")  # 8 bytes of K and V per token


def test_groups_fill_a_quarter_of_free_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA a point needs its host KV plus its whole KV (the device's, on the CPU):
    16 bytes a host token, 8 a device token; groups close past a quarter of the free host
    memory (400 of 1600 B), a point at exactly the quarter still joins, one over it stands
    alone."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1600))
    a, b, c = _point(0, 10), _point(0, 15), _point(2, 0)  # 160, 240, 16 B
    big, d = _point(0, 26), _point(0, 1)  # 416 B: over the quarter alone
    assert _groups([a, b, c, big, d, a], cuda=False) == [[a, b], [c], [big], [d, a]]


def test_groups_on_cuda_also_fit_a_quarter_of_free_device_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA the host keeps the host KV alone (8 B a token) and the device the whole KV:
    here the device's quarter (96 of 384 B) closes the groups; exactly 96 still fits."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 40))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (384, 1 << 40))
    a, b, c = _point(5, 0), _point(3, 4), _point(0, 1)  # device 40, 56, 8 B
    assert _groups([a, b, c, a], cuda=True) == [[a, b], [c, a]]
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * 32))
    e = _point(1, 0)  # host 0 B, device 8 B
    assert _groups([b, b, e, c], cuda=True) == [[b], [b, e], [c]]  # host quarter: 32 B


def _t(*seconds: float, blocks: tuple[int, ...] = ()) -> Timing:
    return Timing(seconds, "fake", 1, blocks)


def _who(r) -> tuple:
    return r.kind, r.name, r.metric, r.unit, r.direction


def test_copy_records_are_labelled_and_return_the_best_host_rate() -> None:
    """Each copy's record named, in GB/s, higher is better, with its method; the host rate
    the CPU bars divide by is the best median, under 1 GB/s here (no floor of 1)."""
    native, torch_copy = _t(1.0, 2.0, blocks=(2,)), _t(4.0)
    device = [_t(0.5), _t(0.25)]
    recs, (host, dev) = drain(AttentionProbe()._copy_records(
        {"native memcpy threads": [native], "torch copy_": [torch_copy], "device": device}, 3))
    n, t, d = recs
    assert t.params["how"] == "torch copy_" and t.samples == [COPY_BYTES / 4.0 / 1e9]
    assert [_who(r) for r in recs] == [("probe", "attention", "host_copy_gbps", "GB/s",
                                        "higher")] * 2 + [("probe", "attention",
                                                           "device_copy_gbps", "GB/s",
                                                           "higher")]
    assert n.params == {"how": "native memcpy threads", "bytes": COPY_BYTES, "threads": 3}
    assert n.method == Timing.join([native]).method()
    assert d.params == {"bytes": DEVICE_COPY_BYTES, "counted": "read+write"}
    assert d.method == Timing.join(device).method() and d.method["blocks"] == [1, 1]
    assert d.samples == [2 * DEVICE_COPY_BYTES / s / 1e9 for s in (0.5, 0.25)]
    assert host == n.value == pytest.approx((COPY_BYTES + COPY_BYTES / 2) / 2e9, rel=1e-12)
    assert host < 1
    assert dev == d.value


def test_copies_time_the_native_torch_and_device_copies(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """One pass of the copies: the native memcpy of COPY_BYTES once on the probe's threads
    (its nanoseconds as seconds), torch's copy_ host to host, and with CUDA the device copy
    from the third buffer into the fourth, each under the probe's policy."""
    import kvbench.native

    calls: list[tuple] = []
    so = SimpleNamespace(kvb_memcpy_threads=lambda *a: calls.append(("memcpy", *a)) or 5e8)
    monkeypatch.setattr(kvbench.native, "lib", lambda: so)

    def timer(kind: str):
        def fake(fn, policy, **kw):
            calls.append((kind, policy, kw))
            got = fn()
            return _t(got if kind == "native" else 1.0)
        return fake

    for kind in ("native", "host", "cuda"):
        monkeypatch.setattr(attention, f"time_{kind}", timer(kind))
    bufs = tuple(torch.full((8,), float(i)) for i in range(4))
    probe = AttentionProbe()
    probe.policy = Policy(warmup=2)
    got = probe._copies(bufs, 3)
    assert list(got) == ["native memcpy threads", "torch copy_", "device"]
    assert got["native memcpy threads"].seconds == (0.5,)
    assert calls[0] == ("native", probe.policy, {})
    assert calls[1] == ("memcpy", bufs[1].data_ptr(), bufs[0].data_ptr(), COPY_BYTES, 1, 3)
    assert [c[:2] for c in calls[2:]] == [("host", probe.policy), ("cuda", probe.policy)]
    assert torch.equal(bufs[1], bufs[0]) and torch.equal(bufs[3], bufs[2])  # both copied
    assert not torch.equal(bufs[2], bufs[0])
    assert list(probe._copies(bufs[:2], 3)) == ["native memcpy threads", "torch copy_"]


class FakeWork:
    """A workload whose steps return their names, so a test sees what each timer ran."""

    def __init__(self, device: str) -> None:
        self.device, self.threads = device, 1
        self.p = Point(1, 2, 1, 4, 8, 16, 1, "float32")
        for step in ("gpu", "transfer", "gpu_transfer", "cpu_dense", "cpu_sparse", "hybrid",
                     "sdpa"):
            setattr(self, step, (lambda s: lambda: s)(step))
        self.device_part = lambda: ("d0", "d1")
        self.cpu_sparse = lambda: ("h0", "h1")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_measure_times_each_mode_s_steps_on_its_clock(device: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What each mode times: on CUDA a device step on CUDA events with GPU_CALLS calls
    behind a cover, the host parts and the hybrid step (synchronised) on the host clock."""
    import kvbench.kernels

    def timer(kind: str):
        def fake(fn, policy, **kw):
            ran.append((kind, fn(), kw))
            return _t(float(len(ran)))
        return fake

    monkeypatch.setattr(attention, "time_cuda", timer("cuda"))
    monkeypatch.setattr(attention, "time_host", timer("host"))
    monkeypatch.setattr(kvbench.kernels, "merge", lambda *a: ("merge", *a))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: "synced")
    probe, w = AttentionProbe(), FakeWork(device)
    probe.policy = Policy()
    dev = ("cuda", {"calls": attention.GPU_CALLS, "cover": True}) if device == "cuda" \
        else ("host", {})
    want = {
        "gpu": {"total": "gpu"},
        "gpu-transfer": {"transfer": "transfer", "gpu": "gpu", "total": "gpu_transfer"},
        "cpu-sparse": {"total": ("h0", "h1")},
        "hybrid": {"gpu": ("d0", "d1"), "cpu": ("h0", "h1"),
                   "merge": ("merge", "d0", "d1", "h0", "h1"),
                   "total": ("hybrid", "synced" if device == "cuda" else None)}}
    for mode, parts in want.items():
        ran: list[tuple] = []
        got = probe._measure(w, mode, None)
        assert list(got) == list(parts), mode
        clocks = {"cpu": ("host", {}), "total": ("host", {})} if mode in (
            "cpu-sparse", "hybrid") else {}
        for i, (part, what) in enumerate(parts.items()):
            kind, kw = clocks.get(part, dev)
            assert ran[i] == (kind, what, kw), (mode, part)
            assert got[part].seconds == (float(i + 1),)


def test_every_bar_with_its_statistic_and_verdict_at_the_limit() -> None:
    """Decode at exactly BIG_KV (64 MiB) of host KV: the host-copy bar applies; SDPA's time
    ratio exactly at its bar passes (>=), the read ratio of 0 fails (no floor), the merge's
    share exactly at 0.05 passes (<=); one pass, so no blocks; a GPU time without a device
    copy rate gives no GPU bar."""
    from kvbench.kernels.cpu import isa

    p = Point(1, 1, 1, 128, 0, 65536, 1, "float32")
    assert p.kv_bytes(p.host_tokens) == BIG_KV
    dense, sparse = _t(0.5, 0.25, blocks=(2,)), _t(0.125, 0.125, blocks=(2,))
    res = {"cpu-dense": (dense, BIG_KV), "sdpa": [1.0, 1.0], "read": [0.0, 0.0],
           "cpu-sparse": (sparse, BIG_KV / 8), "hybrid": (_t(1.0), 2.0),
           "merge": _t(0.05), "gpu": (_t(1e-3), 1e9)}
    params = {"batch": 1}
    recs = list(AttentionProbe()._bars(p, params, res, host_bw=2.0, dev_bw=None))
    medians = {"statistic": "ratio of medians"}
    rounds = {"statistic": "median of per-round ratios (interleaved rounds)"}
    per_pass = {"statistic": "median of per-pass ratios of medians"}
    dense_gbps = BIG_KV / 0.375 / 1e9
    want = [
        ("bar.cpu_dense_over_host_copy", "higher", [dense_gbps / 2.0],
         {**medians, "bar": ">= 0.6", "pass": dense_gbps / 2.0 >= 0.6}),
        ("bar.sdpa_time_over_cpu_dense_time", "higher", [1.0, 1.0],
         {**rounds, "goal": ">= 1.5", "bar": ">= 1.0", "pass": True}),
        ("bar.cpu_dense_over_host_read", "higher", [0.0, 0.0],
         {**rounds, "isa": str(isa()), "bar": ">= 0.85", "pass": False}),
        ("bar.cpu_sparse_over_dense_gbps", "higher",
         [(BIG_KV / 8 / 0.125) / (BIG_KV / 0.375)],
         {**per_pass, "bar": ">= 0.5", "pass": False}),
        ("bar.merge_share_of_hybrid", "lower", [0.05],
         {**per_pass, "bar": "<= 0.05", "pass": True})]
    assert len(recs) == len(want)
    for r, (metric, direction, samples, method) in zip(recs, want, strict=True):
        assert _who(r) == ("probe", "attention", metric, "ratio", direction)
        assert r.samples == pytest.approx(samples, rel=1e-12) and r.params == params
        assert r.method == method, metric
    # a KV one token short of BIG_KV, or an append step: no host-copy bar
    short = Point(1, 1, 1, 128, 0, 65535, 1, "float32")
    assert "bar.cpu_dense_over_host_copy" not in {
        r.metric for r in AttentionProbe()._bars(short, {}, res, 2.0, None)}
    (gpu,) = [r for r in AttentionProbe()._bars(p, {}, {"gpu": (_t(1e-3), 1e9)}, 2.0, 500.0)]
    assert _who(gpu) == ("probe", "attention", "bar.gpu_decode_over_device_copy", "ratio",
                         "higher") and gpu.samples == [2.0]
    append = Point(1, 1, 1, 128, 0, 65536, 2, "float32")
    got = {r.metric: r for r in AttentionProbe()._bars(append, {}, res, 2.0, 1.0)}
    assert "bar.cpu_dense_over_host_copy" not in got
    assert "bar.gpu_decode_over_device_copy" not in got  # decode only


def test_read_ratios_and_records_name_their_quantities() -> None:
    """The read loop's record and a GPU mode's records (CUDA's, on a fake workload): named,
    in their units, the GPU part the step itself, its KV bytes the whole cache's."""
    w = SimpleNamespace(p=Point(1, 2, 1, 4, 8, 16, 1, "float32"), total=24)
    probe = AttentionProbe()
    res: dict = {}
    (read,) = probe._read_ratios(w, {"mode": "cpu-dense"}, _t(0.5), _t(1.0), _t(0.25), res)
    assert _who(read) == ("probe", "attention", "host_read_gbps", "GB/s", "higher")
    assert read.params == {"mode": "cpu-dense", "how": "native read loop",
                           "bytes": w.p.kv_bytes(16)}
    assert res["sdpa"] == [2.0] and res["read"] == [0.5]
    total = _t(0.01, 0.02)
    recs = list(probe._records(w, "gpu", {"mode": "gpu"}, {"total": total}, res))
    assert [_who(r) for r in recs] == [
        ("probe", "attention", "time", "s", "lower"),
        ("probe", "attention", "time_gpu", "s", "lower"),
        ("probe", "attention", "kv_read_gbps", "GB/s", "higher")]
    assert recs[1].samples == [0.01, 0.02]
    assert recs[2].params["kv_bytes"] == w.p.kv_bytes(24) and res["gpu"] == (total, 768)


def test_dense_rounds_time_seconds_and_read_the_kv_once(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The dense decode rounds: the kernel and SDPA on the host clock in seconds, the read
    loop over the KV's bytes once on the kernel's threads (its nanoseconds as seconds); the
    torch thread count put back after."""
    import kvbench.native

    calls: list[tuple] = []
    so = SimpleNamespace(kvb_read_threads=lambda *a: calls.append(a) or 2.5e8)
    monkeypatch.setattr(kvbench.native, "lib", lambda: so)

    def rounds(fns, policy, timer):
        return [_t(fn()) for fn in fns]

    monkeypatch.setattr(attention, "time_rounds", rounds)
    w = FakeWork("cpu")
    buf = torch.zeros(4)
    before = torch.get_num_threads()
    probe = AttentionProbe()
    probe.policy = Policy()
    got = probe._dense_rounds(w, buf)
    assert torch.get_num_threads() == before
    assert all(0 < got[k].seconds[0] < 1 for k in ("total", "sdpa"))
    assert got["read"].seconds == (0.25,)
    assert calls == [(buf.data_ptr(), w.p.kv_bytes(16), 1, 1)]


def test_a_three_pass_run_at_big_kv_with_every_byte_kept(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """keep = 1 (every host token) is allowed; three passes at min-time 1 s take the policy
    (6 repetitions at least, 50 at most, 4 s at most, shared by the passes); at 64 MiB of KV
    the dense decode is held against the best host copy; every record, waived ones too, is
    the probe's."""
    policies: set = set()

    def timer(seconds: tuple[float, ...]):
        def fake(fn, policy, **kw):
            policies.add(policy)
            return _t(*seconds)
        return fake

    monkeypatch.setattr(attention, "time_host", timer((0.5, 0.25)))
    monkeypatch.setattr(attention, "time_native", timer((0.125,)))
    monkeypatch.setattr(attention, "time_rounds", lambda fns, policy, timer: (
        policies.add(policy), [_t(0.01), _t(0.02), _t(0.005)])[1])
    config = AttentionConfig(batch="1", heads="1", kv_heads="1", head_dim="128",
                             gpu_tokens="16", host_tokens="64K", query="1", dtype="float32",
                             keep=1.0, threads=1, min_time=1.0, passes=3)
    recs = list(AttentionProbe().run(config))
    assert {r.name for r in recs} == {"attention"}  # the waived GPU modes' too
    assert {r.params.get("mode") for r in recs if r.status == "waived"} == {
        "gpu", "gpu-transfer", None}
    assert policies == {Policy(warmup=1, min_reps=6, min_time_s=1.0, max_reps=50,
                               max_time_s=4.0).share(3)}
    (bar,) = [r for r in recs if r.metric == "bar.cpu_dense_over_host_copy"]
    host_bw = max(COPY_BYTES / 0.125, COPY_BYTES / 0.375) / 1e9
    assert bar.samples == pytest.approx([BIG_KV / 0.01 / 1e9 / host_bw], rel=1e-12)
    with pytest.raises(KvbenchError) as e:
        list(AttentionProbe().run(AttentionConfig(min_time=-1.0, modes="cpu-dense")))
    assert str(e.value) == "min-time must be >= 0"
