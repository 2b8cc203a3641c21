"""pnm-kv and png-kv (CXL-PNM) against independent references: page selection by loops,
Steady-Select (Alg. 1 lines 7-11) as set operations, the devices' counted work, the
device role's NUMA placement on a fake topology, and their bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ancestors, assert_usage_error, cli

from kvbench.cli import main
from kvbench.models import ModelSpec
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies import _pnm
from kvbench.strategies.png_kv import PngKV, PngParams
from kvbench.strategies.pnm_kv import PnmKV, PnmParams

SPEC = ModelSpec("tiny-gqa", "llama", 2, 6, 2, 48, 96, 100, 512, head_dim=8)  # G = 3
CPU = torch.device("cpu")


def ctx(max_len: int = 128, batch: int = 2, device: torch.device = CPU) -> RunContext:
    return RunContext(SPEC, 2, batch, max_len, torch.float32, device, CPU,
                      Counters(SPEC.n_kv_heads, 4, cuda=device.type == "cuda"))


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    w = torch.softmax((k.double() @ q.double()) * q.shape[0] ** -0.5, dim=0)
    return (w[:, None] * v.double()).sum(0)


def budget_pages(q: torch.Tensor, keys: torch.Tensor, page: int, k_pages: int, sinks: int,
                 window: int) -> tuple[list[int], list[int]]:
    """(selected pages, the ranking S) of one KV head by loops: min/max bound summed over
    the group's queries q [G, D]; sinks and window first, then by score."""
    n = keys.shape[0]
    n_pages = -(-n // page)
    score = []
    for p in range(n_pages):
        kp = keys[p * page:min(n, (p + 1) * page)]
        score.append(float(sum(torch.maximum(x * kp.amax(0), x * kp.amin(0)).sum()
                               for x in q)))
    forced = set(range(min(sinks, n_pages))) | set(range(max(n_pages - window, 0), n_pages))
    rest = sorted(set(range(n_pages)) - forced, key=lambda p: -score[p])
    ranking = sorted(forced, key=lambda p: -score[p]) + rest
    if k_pages >= n_pages:
        return list(range(n_pages)), ranking
    return sorted(forced | set(rest[:k_pages - len(forced)])), ranking


def _steps(s, g, k, v, n_steps: int, c: RunContext):
    """n_steps decode steps of s on c's accelerator: (q, k, v, out) on the CPU."""
    for step in range(n_steps):
        c.counters.step = step + 1
        b = c.batch
        kn, vn = torch.randn(b, 2, 1, 8, generator=g) * 2, torch.randn(b, 2, 1, 8, generator=g)
        q = torch.randn(b, 6, 1, 8, generator=g)
        out = s.decode(1, q.to(c.accel), kn.to(c.accel), vn.to(c.accel)).cpu()
        k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
        yield q, k, v, out


@pytest.mark.parametrize("native", [True, False])
def test_pnm_kv_decode_matches_reference(device: torch.device, native: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Its selection on the CPU's native call (Quest's) and in torch ops alike."""
    from kvbench.kernels import cpu

    if not native:
        monkeypatch.setattr(cpu, "page_select_ok", lambda *a: False)
    g = torch.Generator().manual_seed(0)
    page, budget = 4, 20  # 5 pages: 1 sink, 2 window, 2 by score
    c = ctx(device=device)
    s = PnmKV(PnmParams(budget_tokens=budget, page_size=page, sinks=1, window_pages=2,
                        dense_layers=1), c)
    k0, v0 = torch.randn(2, 2, 37, 8, generator=g) * 2, torch.randn(2, 2, 37, 8, generator=g)
    s.prefill(1, torch.randn(2, 6, 37, 8, generator=g).to(device), k0.to(device), v0.to(device))
    for q, k, v, out in _steps(s, g, k0, v0, 6, c):
        for b in range(2):
            for j in range(2):
                sel, _ = budget_pages(q[b, 3 * j:3 * j + 3, 0], k[b, j], page, 5, 1, 2)
                toks = [t for p in sel for t in range(p * page, min(k.shape[2], p * page
                                                                     + page))]
                for h in range(3 * j, 3 * j + 3):
                    ref = ref_attention(q[b, h, 0], k[b, j, toks], v[b, j, toks])
                    assert torch.allclose(out[b, h, 0].double(), ref, atol=1e-5)
    assert c.counters.step_total("tokens", "pnm", 1) > 0
    assert c.counters.step_total("tokens", "accel", 1) == 0  # PNM-KV: no GPU attention


def test_png_kv_steady_select_is_algorithm_1(device: torch.device) -> None:
    """The pool against a set simulation of Alg. 1 lines 7-11 with the [:|e|] slice, the
    output equal to PNM-KV's (same budget set), recalls counted per step."""
    g = torch.Generator().manual_seed(1)
    page, budget, steady = 4, 24, 12  # 6 budget pages, 3 steady slots
    params = dict(budget_tokens=budget, page_size=page, sinks=1, window_pages=1,
                  dense_layers=1)
    c, c2 = ctx(batch=3, device=device), ctx(batch=3, device=device)  # B told from Hkv
    png = PngKV(PngParams(**params, steady_tokens=steady), c)
    pnm = PnmKV(PnmParams(**params), c2)
    k0, v0 = torch.randn(3, 2, 30, 8, generator=g) * 2, torch.randn(3, 2, 30, 8, generator=g)
    q0 = torch.randn(3, 6, 30, 8, generator=g)
    png.prefill(1, q0.to(device), k0.to(device), v0.to(device))
    pnm.prefill(1, q0.to(device), k0.to(device), v0.to(device))
    pool = [[[None] * 3 for _ in range(2)] for _ in range(3)]  # slot -> page
    recalled = 0
    for q, k, v, out in _steps(png, g, k0, v0, 12, c):
        c2.counters.step = c.counters.step
        out2 = pnm.decode(1, q.to(device), k[:, :, -1:].to(device),
                          v[:, :, -1:].to(device)).cpu()
        assert torch.allclose(out, out2, atol=1e-5)
        nf = k.shape[2] // page
        step_r = step_e = 0
        for b in range(3):
            for j in range(2):
                sel, ranking = budget_pages(q[b, 3 * j:3 * j + 3, 0], k[b, j], page, 6, 1, 1)
                budget_set = [p for p in ranking if p in sel and p < nf]  # S[:T_Budget]
                slots = pool[b][j]
                slots_before = list(slots)
                resident = {p for p in slots if p is not None}
                e = [i for i, p in enumerate(slots) if p is None or p not in budget_set]
                r = [p for p in budget_set if p not in resident][:len(e)]
                for i in e:
                    slots[i] = None
                for i, p in zip(e, r, strict=False):  # |r| <= |e|
                    slots[i] = p
                recalled += len(r)
                step_r += len(r)
                step_e += sum(1 for i in e if slots_before[i] is not None)
                got = png.slot_page[1][b, j].tolist()
                assert got == [-1 if p is None else p for p in slots], (c.counters.step, b, j)
        step = c.counters.step  # recalls from the device's memory, outputs and lse back
        assert c.counters.step_total("pages", "evicted", step) == step_e
        assert c.counters.step_total("bytes_moved", "h2d", step) == \
            2.0 * step_r * page * 8 * 4 + 3 * 6 * 8 * 4 + 3 * 6 * 4
    counted = sum(sum(x.values()) for (qn, w, _), x in c.counters._v.items()
                  if qn == "pages" and w == "recalled")
    assert "bookkeeping.steady_select" in {w for (qn, w, _) in c.counters._v if qn == "time"}
    assert counted == recalled > 0
    assert c.counters.step_total("tokens", "accel", 12) > 0  # the GPU attended its pages


def test_png_kv_device_attention_runs_beside_the_gpu_in_the_trace() -> None:
    """Section 3.3: the device's attention and the GPU's steady attention of a layer run
    concurrently: neither waits (transitively) for the other in the stage graph."""
    g = torch.Generator().manual_seed(3)
    c = ctx()
    s = PngKV(PngParams(budget_tokens=24, page_size=4, sinks=1, window_pages=1,
                        dense_layers=1, steady_tokens=12), c)
    k, v = torch.randn(2, 2, 30, 8, generator=g), torch.randn(2, 2, 30, 8, generator=g)
    s.prefill(1, torch.randn(2, 6, 30, 8, generator=g), k, v)
    for _ in _steps(s, g, k, v, 3, c):
        pass
    tasks = c.counters.graph.tasks

    last = [t for t in tasks if t.step == 3]  # scoring, recall, device and GPU attention
    gpu = [t.id for t in last if t.resource == "accel"]
    dev = [t.id for t in last if t.resource == "pnm"][-1]  # its attention, after scoring
    assert gpu and dev not in ancestors(tasks, gpu[0])
    assert gpu[0] not in ancestors(tasks, dev)


@pytest.mark.parametrize("devices", [1, 4])
def test_tp_counts_sorts_and_reductions_dp_none(devices: int) -> None:
    """Same outputs under dp and tp; tp with 4 devices over 6 query heads (shards 0,0,1,2,
    2,3) splits each 3-head group over 2 devices: 2 sorts and 1 reduction per group."""
    outs, counts = {}, {}
    for mode in ("dp", "tp"):
        g = torch.Generator().manual_seed(2)
        c = ctx()
        s = PnmKV(PnmParams(budget_tokens=16, page_size=4, sinks=1, window_pages=1,
                            dense_layers=1, devices=devices, parallel=mode), c)
        k, v = torch.randn(2, 2, 30, 8, generator=g), torch.randn(2, 2, 30, 8, generator=g)
        s.prefill(1, torch.randn(2, 6, 30, 8, generator=g), k, v)
        outs[mode] = [out for *_, out in _steps(s, g, k, v, 2, c)]
        counts[mode] = {q: c.counters.step_total(q, "pnm", 1)
                        for q in ("topk_sorts", "reductions")}
        loads = [c.counters.step_total("device_load", f"pnm{d}", 1) for d in range(devices)]
        busy = [d < 2 or mode == "tp" for d in range(devices)]  # dp: 2 requests
        assert [x > 0 for x in loads] == busy
    for a, b in zip(outs["dp"], outs["tp"], strict=True):
        assert torch.equal(a, b)
    assert counts["dp"] == {"topk_sorts": 2 * 2, "reductions": 0}
    split = devices == 4
    assert counts["tp"] == {"topk_sorts": 2 * (4 if split else 2),
                            "reductions": 2 * (2 if split else 0)}


def test_device_role_on_memory_only_node(fake_sysfs: Path, monkeypatch, tmp_path) -> None:
    """On a machine with a CXL memory-only node (fake node 2) the KV and digests are
    allocated there, and the run records the node."""
    placed: list[int] = []

    def fake_alloc(node, shape, dtype, keep):
        placed.append(node)
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(_pnm, "SYSFS_ROOT", str(fake_sysfs))
    monkeypatch.setattr(_pnm, "alloc_on_node", fake_alloc)
    assert _pnm.device_node(-1).id == 2
    s = PngKV(PngParams(budget_tokens=16, page_size=4, dense_layers=0), ctx())
    assert s.dev.node == 2 and placed == [2] * 8  # k, v, lo, hi per layer
    out = tmp_path / "x.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["run", "pnm-kv", "--weights", "random", "--layers", "3", "--prompt-len", "40",
              "--gen-len", "2", "--out", str(out)])
    assert e.value.code == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["params"]["device_node"] for r in recs if r["kind"] == "run"} == {2}
    assert set(placed) == {2}


def test_device_buffers_really_placed_on_this_machine() -> None:
    """Unfaked allocation: every KV and digest buffer of the device role sits on the node
    the strategy chose (libnuma's placement check), the first memory-only node if this
    machine has one, else the local node."""
    from kvbench.topology import libnuma, read_nodes

    if libnuma() is None:
        pytest.skip("libnuma unavailable: buffers are plain host memory")
    s = PnmKV(PnmParams(budget_tokens=16, page_size=4, dense_layers=0), ctx())
    cxl = [n.id for n in read_nodes("/") if n.memory_only]
    assert s.dev.node == (cxl[0] if cxl else s.dev.node)
    assert len(s.dev.buffers) == 8  # k, v, lo, hi per layer
    assert {b.node for b in s.dev.buffers} == {s.dev.node}
    assert {b.placement for b in s.dev.buffers} == {"verified"}


def _no_memory_node(root: Path) -> None:
    d = root / "sys/devices/system/node/node3"
    d.mkdir()
    (d / "cpulist").write_text("\n")
    (d / "meminfo").write_text("Node 3 MemTotal:       0 kB\n")


@pytest.mark.parametrize("args, message", [
    (["pnm-kv", "--device-node", "7"], "NUMA node 7 does not exist"),
    (["png-kv", "--device-node", "3"], "--device-node 3: NUMA node 3 has no memory"),
    (["png-kv", "--steady-tokens", "8192"], "--steady-tokens 8192: must be in [0, "
                                            "--budget-tokens 4096]"),
    (["pnm-kv", "--budget-tokens", "16"], "smaller than one page of 32 tokens"),
    (["png-kv", "--devices", "0"], "--devices 0: at least one device role"),
    (["pnm-kv", "--parallel", "pp"], "--parallel 'pp': one of dp, tp"),
    (["pnm-kv", "--model", "llama-3.1-8b", "--layers", "32", "--batch", "4",
      "--prompt-len", "130000"], "KV does not fit the device roles: 131 GiB per device "
                                 "(4 of 4 sequences x 130033 tokens"),
])
def test_bad_input_exits_2(args: list[str], message: str, fake_sysfs: Path, monkeypatch,
                           capsys, tmp_path: Path) -> None:
    _no_memory_node(fake_sysfs)
    monkeypatch.setattr(_pnm, "SYSFS_ROOT", str(fake_sysfs))
    base = ["--weights", "random", "--prompt-len", "40", "--gen-len", "32"]
    assert_usage_error(cli(["run", args[0], *base, *args[1:], "--out",
                            str(tmp_path / "x.jsonl")], capsys), message)
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["pnm-kv", "png-kv"])
def test_cuda_exact_setting_equals_full(name: str) -> None:
    """On a GPU: the device role stays on the host, the accelerator's part (png-kv's pool)
    on CUDA; the exact setting's NLLs equal full attention's (float32)."""
    import dataclasses

    from kvbench.models.weights import load
    from kvbench.runtime.run import decode_run
    from kvbench.strategies import STRATEGIES

    cuda = torch.device("cuda")
    model = load(SPEC, "random", 2, torch.float32, cuda, seed=1).model
    rows = torch.randint(0, 100, (2, 90), generator=torch.Generator().manual_seed(0)).to(cuda)
    nll = {}
    for n in ("full", name):
        c = RunContext(SPEC, 2, 2, 90, torch.float32, cuda, CPU, Counters(2, 4, cuda=True),
                       model)
        cls = STRATEGIES.get(n)
        params = None if n == "full" else dataclasses.replace(
            cls.params(), budget_tokens=1 << 20, page_size=8, dense_layers=1)
        s = cls(params, c)
        model.setup(s, c.counters, 90)
        nll[n] = decode_run(model, s, rows, 40, "eval", torch.cuda.synchronize).nll
    assert max(abs(a - b) for a, b in zip(nll["full"], nll[name], strict=True)) < 1e-4


@pytest.mark.parametrize("cls, params", [(PnmKV, PnmParams), (PngKV, PngParams)])
def test_attended_mask_is_on_the_accelerator(cls, params) -> None:
    """GPU audit finding 2: the device role's positions live on the host, but eval mode
    gathers the attended mask with indices on the accelerator, so the mask must be there
    (a CPU mask met CUDA indices and every pnm/png eval run on a GPU died). The run is on
    the CPU; the context then names another accelerator ('meta'), which the dense and the
    sparse layer's masks must follow."""
    import dataclasses

    g = torch.Generator().manual_seed(0)
    c = ctx()
    s = cls(params(budget_tokens=8, page_size=4, sinks=1, window_pages=1, dense_layers=1), c)
    k0, v0 = torch.randn(2, 2, 37, 8, generator=g), torch.randn(2, 2, 37, 8, generator=g)
    for layer in (0, 1):
        s.prefill(layer, torch.randn(2, 6, 37, 8, generator=g), k0, v0)
        s.decode(layer, torch.randn(2, 6, 1, 8, generator=g), k0[:, :, :1], v0[:, :, :1])
    on_cpu = {layer: s.attended(layer) for layer in (0, 1)}
    assert bool(on_cpu[0].all()) and not bool(on_cpu[1].all())  # dense, then sparse
    s.ctx = dataclasses.replace(c, accel=torch.device("meta"))
    for layer in (0, 1):
        mask = s.attended(layer)
        assert mask.device.type == "meta" and mask.shape == on_cpu[layer].shape == (2, 6, 38)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["pnm-kv", "png-kv"])
def test_cuda_eval_mode_counts_topk_recall(name: str) -> None:
    """On a GPU, eval mode (the full-attention shadow) over a budget below the context:
    the attended masks meet the reference's CUDA indices, and every decode step of the
    sparse layer gets a top-key recall in [0, 1], below 1 somewhere."""
    import dataclasses

    from kvbench.models.weights import load
    from kvbench.runtime.run import decode_run
    from kvbench.runtime.shadow import Shadow
    from kvbench.strategies import STRATEGIES

    cuda = torch.device("cuda")
    model = load(SPEC, "random", 2, torch.float32, cuda, seed=1).model
    rows = torch.randint(0, 100, (2, 90), generator=torch.Generator().manual_seed(0)).to(cuda)
    counters = Counters(2, 4, cuda=True)
    c = RunContext(SPEC, 2, 2, 90, torch.float32, cuda, CPU, counters, model)
    cls = STRATEGIES.get(name)
    s = Shadow(cls(dataclasses.replace(cls.params(), budget_tokens=32, page_size=8, sinks=1,
                                       window_pages=1, dense_layers=1), c), c)
    model.setup(s, counters, 90)
    decode_run(model, s, rows, 10, "eval", torch.cuda.synchronize)
    s.flush()
    recall = {layer: steps for qn, _, layer, steps in counters.series() if qn == "topk_recall"}
    assert len(recall[1]) == 10 and all(0 <= r <= 1 for r in recall[1].values())
    assert min(recall[1].values()) < 1


@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_the_devices_selection_work_counted(mode: str) -> None:
    """One selection over 30 tokens in pages of 4 (8 pages, budget 4), batch 2, 2 KV heads,
    4 devices: the digests read (2 x 8 pages of 8 fp32 per row) and scored (4 FLOPs per
    query head, page and dim); dp: a sort per (request, KV head) on the request's device;
    tp (shards 0,0,1,2,2,3: each group on 2 devices): a sort per (request, group, device),
    one reduction per split group and request, its scores over the pnm_reduce link."""
    c = ctx(max_len=64)
    dkv = _pnm.DeviceKV(PnmParams(budget_tokens=16, page_size=4, sinks=1, window_pages=1,
                                  dense_layers=1, devices=4, parallel=mode), c)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 30, 8, generator=g), torch.randn(2, 2, 30, 8, generator=g)
    assert dkv.write(1, k, v) == 30
    counters = c.counters
    assert counters.step_total("bytes_moved", "d2h", 0) == 2 * k.numel() * 4
    mask, ranked = dkv.select(1, torch.randn(2, 6, 1, 8, generator=g), 30)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (2, 2, 8)
    assert mask.sum(-1).tolist() == [[4, 4], [4, 4]] and bool(mask[:, :, 0].all())
    assert bool(mask[:, :, 7].all())  # the sink page and the window's
    assert bool(torch.isinf(ranked[:, :, 0]).all()) and bool(torch.isinf(ranked[:, :, 7]).all())
    assert not bool(torch.isinf(ranked[:, :, 1:7]).any())
    digests = 2 * 2 * 2 * 8 * 8 * 4
    assert counters.step_total("bytes_read", "pnm", 0) == digests
    assert counters.step_total("flops", "pnm", 0) == 4 * 2 * 6 * 8 * 8
    sorts = 2 * 2 if mode == "dp" else 2 * 4
    assert counters.step_total("topk_sorts", "pnm", 0) == sorts
    assert counters.step_total("topk_candidates", "pnm", 0) == sorts * 8
    loads = [counters.step_total("device_load", f"pnm{d}", 0) for d in range(4)]
    if mode == "dp":  # request r on device r % 4, its digests read there
        assert loads == [digests / 2, digests / 2, 0.0, 0.0]
        assert counters.step_total("reductions", "pnm", 0) == 0.0
        assert counters.step_total("bytes_moved", "pnm_reduce", 0) == 0.0
    else:  # each device holds half a group: half the request's digests of that KV head
        assert loads == [digests / 2 / 2 * 2] * 4
        assert counters.step_total("reductions", "pnm", 0) == 2 * 2
        assert counters.step_total("bytes_moved", "pnm_reduce", 0) == 4.0 * 4 * 8


@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_native_selection_lists_and_counts_what_the_mask_does(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """select_tokens in one native call (CPU float32) against `select` + `mask_tokens`:
    the same positions and lengths, the same work counted, budgets below and covering the
    context."""
    from kvbench.kernels import cpu
    from kvbench.kernels.attention import backend_use

    assert cpu.native_built()
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 2, 61, 8, generator=g), torch.randn(2, 2, 61, 8, generator=g)
    q = torch.randn(2, 6, 1, 8, generator=g)
    for budget in (16, 28, 64, 512):
        got = []
        for native in (True, False):
            c = ctx(max_len=64)
            dkv = _pnm.DeviceKV(PnmParams(budget_tokens=budget, page_size=4, sinks=1,
                                          window_pages=2, dense_layers=1, devices=4,
                                          parallel=mode), c)
            dkv.write(1, k, v)
            calls = []
            backend_use(reset=True)
            with monkeypatch.context() as m:
                if not native:
                    m.setattr(cpu, "page_select_ok", lambda *a: False)
                m.setattr(cpu, "page_select", lambda *a, f=cpu.page_select, seen=calls:
                          seen.append(1) or f(*a))
                pos, lens = dkv.select_tokens(1, q, 61)
            assert len(calls) == native
            assert backend_use() == {"decode": "native-select" if native else "torch-select"}
            work = {key: c.counters.step_total(*key, 0) for key in (
                ("bytes_read", "pnm"), ("flops", "pnm"), ("topk_sorts", "pnm"),
                ("topk_candidates", "pnm"), ("reductions", "pnm"),
                ("bytes_moved", "pnm_reduce"), *(("device_load", f"pnm{d}")
                                                  for d in range(4)))}
            valid = [[pos[b, h, :lens[b, h]].tolist() for h in range(2)] for b in range(2)]
            got.append((lens.tolist(), valid, work))
        assert got[0] == got[1], budget
        most = 61 if budget >= 64 else budget  # 16 pages: the budget covers them at 64
        assert all(x <= most for row in got[0][0] for x in row)
        assert budget < 64 or got[0][0] == [[61, 61], [61, 61]]


def test_mask_tokens_lists_marked_pages_positions_in_order() -> None:
    """Pages 0 and 2 of 4 (pages of 2, 7 tokens): positions 0, 1, 4, 5; the last page holds
    only position 6; the width is `most` pages (at most the mask's), whatever the rows mark,
    so no device value sizes it."""
    mask = torch.tensor([[[True, False, True, False], [False, False, False, True]]])
    pos, lens = _pnm.mask_tokens(mask, 2, 7, 2)
    assert pos.shape == (1, 2, 4) and lens.tolist() == [[4, 1]]
    assert pos[0, 0].tolist() == [0, 1, 4, 5] and pos[0, 1].tolist() == [6, 0, 0, 0]
    wide, wlens = _pnm.mask_tokens(mask, 2, 7, 9)  # clamped to the mask's 4 pages
    assert wide.shape == (1, 2, 8) and wlens.tolist() == [[4, 1]]
    assert wide[..., :4].tolist() == pos.tolist() and not wide[..., 4:].any()
    pos, lens = _pnm.mask_tokens(mask[:, :1], 2, 7, 2)
    assert lens.tolist() == [[4]] and pos[0, 0].tolist() == [0, 1, 4, 5]


@pytest.mark.parametrize(("prompt", "steady"), [(1, 12), (2, 12), (40, 3)])
def test_png_kv_without_a_steady_page_is_pnm_kv(prompt: int, steady: int) -> None:
    """Before the context holds a full page, or with a steady set under one page (a pool of
    no slot, past the budget here), png-kv is pnm-kv: the device attends the budget set and
    only its output comes back (no lse), the bytes per link are pnm-kv's; the tokens it
    attended are reported."""
    g = torch.Generator().manual_seed(4)
    params = dict(budget_tokens=24, page_size=4, sinks=1, window_pages=1, dense_layers=1)
    c, c2 = ctx(), ctx()
    png = PngKV(PngParams(**params, steady_tokens=steady), c)
    assert (png.c == 0) == (steady < 4)
    pnm = PnmKV(PnmParams(**params), c2)
    k0, v0 = torch.randn(2, 2, prompt, 8, generator=g), torch.randn(2, 2, prompt, 8, generator=g)
    q0 = torch.randn(2, 6, prompt, 8, generator=g)
    png.prefill(1, q0, k0, v0)
    pnm.prefill(1, q0, k0, v0)
    for q, k, v, out in _steps(png, g, k0, v0, 1, c):
        c2.counters.step = c.counters.step
        out2 = pnm.decode(1, q, k[:, :, -1:], v[:, :, -1:])
        assert torch.allclose(out, out2, atol=1e-6)
    for link in ("h2d", "d2h"):  # what pnm-kv moves (its output back without an lse)
        assert c.counters.step_total("bytes_moved", link, 1) == \
            c2.counters.step_total("bytes_moved", link, 1)
    assert c.counters.step_total("pages", "recalled", 1) == 0.0
    assert torch.equal(png.attended(1), pnm.attended(1))


@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_attention_load_per_device_counted_without_a_read(mode: str) -> None:
    """count_load files 2 x D x elem bytes per attended token on the device that holds its
    row: dp, request r's on device r % 4; tp (shards 0,0,1,2,2,3 over 2 KV heads: each
    group on 2 devices), each device a copy of its group's tokens. Counted as tensors,
    summed at the step's end."""
    c = ctx(max_len=64)
    dkv = _pnm.DeviceKV(PnmParams(budget_tokens=16, page_size=4, sinks=1, window_pages=1,
                                  dense_layers=1, devices=4, parallel=mode), c)
    lens = torch.tensor([[5, 7], [11, 13]])  # [B, Hkv] tokens attended
    dkv.count_load(lens)
    counters = c.counters
    counters.settle()
    loads = [counters.step_total("device_load", f"pnm{d}", 0) / (2 * 8 * 4) for d in range(4)]
    if mode == "dp":
        assert loads == [5 + 7, 11 + 13, 0.0, 0.0]
    else:  # group 0 (KV head 0) on devices 0, 1; group 1 on devices 2, 3
        assert loads == [5 + 11, 5 + 11, 7 + 13, 7 + 13]
