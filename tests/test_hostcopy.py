"""Host DMA buffers and transfers of the offload strategies (issue 28, GPU audit findings 3,
5, 6, 10, 13, 15, 18, 21): exact pinned sizes, contiguous copies, the schedule of
infinigen's speculation, and (GPU) back-to-back steps against references."""

from __future__ import annotations

import dataclasses
import gc
import math
import sys

import pytest
import torch

from kvbench.memory import HostBuffer
from kvbench.models import ModelSpec
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies import STRATEGIES, NoParams
from kvbench.strategies import _hostcopy as hostcopy
from kvbench.strategies._hgca_kv import HgcaParams, host_dtype, host_threads
from kvbench.strategies.arkvale import ArkValeParams
from kvbench.strategies.infinigen import InfiniGenParams
from kvbench.strategies.scout import ScoutParams

SPEC = ModelSpec("tiny-gqa", "llama", 3, 6, 2, 48, 96, 100, 512, head_dim=8)
CPU = torch.device("cpu")

# settings below each strategy's exactness budget (selection, recall and eviction run)
SPARSE = {
    "offload": NoParams(),
    "hgca": HgcaParams(gpu_tokens=16, block=8, beta=1.0),
    "infinigen": InfiniGenParams(variant="oracle", alpha=1.0, budget_tokens=8, skew_tokens=8,
                                 dense_layers=1),
    "arkvale": ArkValeParams(budget_tokens=64, page_size=16, dense_layers=1),
    "scout": ScoutParams(budget_tokens=64, page_size=16, dense_layers=1, resident_blocks=2,
                         recall_interval=2),
}


def ctx(accel: torch.device = CPU, max_len: int = 90, dtype: torch.dtype = torch.float32,
        model: object = None) -> RunContext:
    return RunContext(SPEC, 3, 2, max_len, dtype, accel, CPU,
                      Counters(SPEC.n_kv_heads, dtype.itemsize, cuda=accel.type == "cuda"),
                      model)


def test_transfer_refuses_strided_and_cross_dtype_copies() -> None:
    """A strided or converting copy would go through pageable temporaries on CUDA."""
    buf = torch.zeros(2, 3, 10, 4)
    src = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 1, 4)
    with pytest.raises(AssertionError, match="strided"):
        hostcopy.transfer(buf[:, :, 2:3], src)  # a slice of [B, H, max_len, D]
    with pytest.raises(AssertionError, match="strided"):
        hostcopy.transfer(torch.zeros(3, 2, 4), src.view(2, 3, 4).transpose(0, 1))
    with pytest.raises(AssertionError, match="convert"):
        hostcopy.transfer(torch.zeros(2, 3, 1, 4, dtype=torch.bfloat16), src)
    tm = torch.zeros(10, 2, 3, 4)  # token-major: a token range is contiguous
    hostcopy.transfer(tm[2:3], hostcopy.tokens_first(src))
    assert torch.equal(hostcopy.heads_first(tm)[:, :, 2:3], src)


def test_hostkv_pins_exactly_the_bytes_asked(monkeypatch) -> None:
    """cudaHostRegister of a HostBuffer of prod(shape) * itemsize bytes (the caching host
    allocator would round 1.07 GB up to 2 GiB); freed with the HostKV."""
    registered: list[int] = []
    monkeypatch.setattr(HostBuffer, "register_cuda", lambda self: registered.append(self.size))
    host = hostcopy.HostKV(pin=True)
    shapes = [((2049, 3, 5, 7), torch.bfloat16), ((129, 2, 16), torch.float32),
              ((11,), torch.int64)]
    for shape, dtype in shapes:
        t = host.empty(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        t.fill_(1)  # the whole range is usable
    want = [math.prod(s) * d.itemsize for s, d in shapes]
    assert registered == want == [b.size for b in host.buffers]
    assert host.pinned == sum(want)
    buffers = list(host.buffers)
    del host, t
    gc.collect()
    assert all(b.ptr == 0 for b in buffers)  # closed


def test_hostkv_unpinned_counts_the_same_bytes() -> None:
    host = hostcopy.HostKV(pin=False)
    t = host.empty((5, 3, 4), torch.float16)
    assert not host.buffers and host.pinned == 5 * 3 * 4 * 2 and t.shape == (5, 3, 4)


def _host_bytes(name: str, s: object) -> int:
    """Bytes the strategy allocated through HostKV (plus hgca's output buffers)."""
    if name != "hgca":
        return s.host.pinned
    he = host_dtype(torch.float32).itemsize
    out = 2 * SPEC.n_heads * (SPEC.head_dim * he + 4)  # kernels.cpu.output_buffers
    return sum(L.host.pinned + out for L in s.layers)


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_placement_pinned_is_what_the_strategy_pins(name: str) -> None:
    """`placement`'s "pinned" (the bytes a CUDA run page-locks) equals what the strategy
    allocates through HostKV, and is 0 off CUDA; it is part of "host"."""
    cls = STRATEGIES.get(name)
    params, _ = cls.for_run(SPARSE[name], 90)
    s = cls(params, ctx())
    on_cuda = cls.placement(params, ctx(torch.device("cuda")))
    assert on_cuda["pinned"] == _host_bytes(name, s) > 0
    assert on_cuda["pinned"] <= on_cuda["host"]
    assert cls.placement(params, ctx())["pinned"] == 0


def test_staging_is_capped_by_the_cache_in_exact_settings() -> None:
    """A budget of 2^20 tokens (the exact setting) stages at most the cache's blocks."""
    p = ScoutParams(budget_tokens=1 << 20, page_size=16, dense_layers=1)
    token = 2 * 2 * SPEC.n_kv_heads * SPEC.head_dim * 4  # batch 2, k and v, fp32
    got = STRATEGIES.get("scout").placement(p, ctx(torch.device("cuda")))["pinned"]
    assert got == token * (2 * 90 + 6 * 16)  # 2 sparse layers + 6 blocks of 16


def test_check_fit_reports_pinned_bytes() -> None:
    from kvbench.runtime.run import RunConfig, check_fit

    cfg = RunConfig(batch=2, prompt_len=40, gen_len=8)
    fit = check_fit(SPEC, 3, cfg, STRATEGIES.get("offload"), NoParams(), CPU, torch.float32)
    assert fit["pinned_bytes"] == 0  # off CUDA nothing is page-locked
    want = STRATEGIES.get("offload").placement(NoParams(), ctx(torch.device("cuda"), 49))
    assert want["pinned"] == 3 * 2 * 2 * 49 * SPEC.n_kv_heads * SPEC.head_dim * 4


def _run(name: str, params: object, accel: torch.device, dtype: torch.dtype,
         steps: int = 40, sync: bool = False) -> list[float]:
    """NLLs of an eval run of a 3-layer random model: 50 prompt tokens, `steps` decoded
    (no device sync between steps unless `sync`)."""
    from kvbench.models.weights import load
    from kvbench.runtime.run import decode_run

    # drawn on the CPU and moved: a CUDA generator draws other weights from the same seed
    model = load(SPEC, "random", 3, dtype, CPU, seed=1).model.to(accel)
    rows = torch.randint(0, 100, (2, 51 + steps),
                         generator=torch.Generator().manual_seed(0)).to(accel)
    c = ctx(accel, 51 + steps, dtype, model)
    cls = STRATEGIES.get(name)
    s = cls(params, c)
    model.setup(s, c.counters, 51 + steps)
    done = torch.cuda.synchronize if sync and accel.type == "cuda" else (lambda: None)
    return decode_run(model, s, rows, steps, "eval", done).nll


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_every_host_device_copy_is_a_checked_transfer(name: str, monkeypatch) -> None:
    """Below the exactness budget (recalls, gathers, evictions run), every module's host
    <-> accelerator copies go through `transfer` (which asserts contiguity), in both
    directions."""
    seen: list[tuple[tuple[int, ...], bool]] = []
    real = hostcopy.transfer

    def spy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(dst.shape), dst.is_contiguous() and src.is_contiguous()))
        return real(dst, src)

    # every strategy module and its helpers imported first: one imported while another
    # parameter's spy is in place would bind that spy, and this run's copies go uncounted
    STRATEGIES.all()
    for mod in [m for k, m in sys.modules.items() if k.startswith("kvbench.strategies.")]:
        if getattr(mod, "transfer", None) is real:
            monkeypatch.setattr(mod, "transfer", spy)
    nll = _run(name, SPARSE[name], CPU, torch.float32, steps=24)
    assert all(math.isfinite(x) for x in nll)
    assert len(seen) > 2 * 3 and all(ok for _, ok in seen)


def test_infinigen_queues_layer_i_before_gathering_for_i_plus_1(monkeypatch) -> None:
    """GPU audit finding 10: layer i's attention is issued before the host reads layer
    i+1's speculation (the ids' copy) and gathers its tokens."""
    from kvbench.kernels import attention
    from kvbench.strategies import infinigen

    order: list[str] = []
    dense, prefetch = attention.dense_attention, infinigen.InfiniGen._prefetch

    def att(*a: object, **k: object) -> object:
        order.append("attention")
        return dense(*a, **k)

    def pre(self: object, layer: int) -> None:
        if self.queued is not None and self.queued[0] == layer + 1:
            order.append(f"gather {layer + 1}")
        prefetch(self, layer)

    monkeypatch.setattr(attention, "dense_attention", att)
    monkeypatch.setattr(infinigen.InfiniGen, "_prefetch", pre)
    _run("infinigen", SPARSE["infinigen"], CPU, torch.float32, steps=12)
    gathers = [i for i, o in enumerate(order) if o.startswith("gather")]
    assert gathers and all(order[i - 1] == "attention" for i in gathers)


def test_infinigen_skews_from_the_first_skew_tokens_queries(monkeypatch) -> None:
    """GPU audit finding 21: a 50-token prompt and --skew-tokens 8: the SVD gets 8 queries
    per head, not all 50."""
    from kvbench.strategies import _infinigen_cache

    got: list[int] = []
    real = _infinigen_cache.skew
    monkeypatch.setattr(_infinigen_cache, "skew",
                        lambda q, *a: got.append(q.shape[2]) or real(q, *a))
    _run("infinigen", SPARSE["infinigen"], CPU, torch.float32, steps=2)
    assert got and set(got) == {8}


def test_hgca_select_clock_starts_after_the_copy_wait(monkeypatch) -> None:
    """GPU audit finding 13: the seconds filed as bookkeeping.select exclude the wait for
    the eviction copy's event."""
    from kvbench.strategies import _hgca_manager

    clock = iter(range(100, 10_000, 10))
    monkeypatch.setattr(_hgca_manager.time, "perf_counter", lambda: float(next(clock)))

    class Copied:
        def synchronize(self) -> None:
            next(clock)  # the wait takes one tick of the fake clock

    s = STRATEGIES.get("hgca")(SPARSE["hgca"], ctx())
    L = s.layers[0]
    k = torch.randn(2, 2, 8, 8)
    took = s._select(L, k, k.clone(), torch.rand(2, 6, 8), 16, Copied())
    assert took == {"select": 10.0}  # one tick: the selection alone


def test_hgca_cpu_threads_default_leaves_a_core_on_cuda() -> None:
    """GPU audit finding 18: --cpu-threads 0 resolves (and is recorded) as the CPUs, less
    one where CUDA is present; an explicit value is kept."""
    from kvbench.kernels.cpu import default_threads

    assert host_threads(False) == default_threads()
    assert host_threads(True) == max(1, default_threads() - 1)
    p, _ = STRATEGIES.get("hgca").for_run(HgcaParams(), 256)
    assert p.cpu_threads == host_threads(torch.cuda.is_available())
    p, _ = STRATEGIES.get("hgca").for_run(HgcaParams(cpu_threads=3), 256)
    assert p.cpu_threads == 3


@pytest.mark.gpu
def test_cuda_hostkv_is_pinned_and_exact() -> None:
    host = hostcopy.HostKV(pin=True)
    t = host.empty((3, 1000, 7), torch.float16)
    assert t.is_pinned() and host.buffers[0].size == 3 * 1000 * 7 * 2
    x = torch.randn(3, 1000, 7, dtype=torch.float16, device="cuda")
    hostcopy.transfer(t, x)
    back = hostcopy.transfer(torch.empty_like(x), t)
    torch.cuda.synchronize()
    assert torch.equal(back, x)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SPARSE))
def test_cuda_back_to_back_steps_match_cpu(name: str) -> None:
    """Below the exactness budget, float32, no device sync between steps: the CUDA paths
    (async pinned copies, side streams, events) give the CPU run's NLLs. A copy read
    before it lands, or a host buffer rewritten while a copy reads it, shows as a gap."""
    cuda = _run(name, SPARSE[name], torch.device("cuda"), torch.float32)
    cpu = _run(name, SPARSE[name], CPU, torch.float32)
    assert all(math.isfinite(x) for x in cuda)
    assert max(abs(a - b) for a, b in zip(cuda, cpu, strict=True)) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SPARSE))
def test_cuda_bf16_exact_setting_equals_full(name: str) -> None:
    """bfloat16 (the CUDA default), exact setting, steps back to back: full's NLLs."""
    cls = STRATEGIES.get(name)
    params = dataclasses.replace(SPARSE[name], **dict(cls.exact)) if cls.exact else NoParams()
    got = _run(name, params, torch.device("cuda"), torch.bfloat16)
    ref = _run("full", NoParams(), torch.device("cuda"), torch.bfloat16)
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 3e-2


def test_to_host_off_cuda_hands_back_the_tensors_and_no_event() -> None:
    """Off CUDA there is nothing to wait for: the tensors themselves, no event."""
    q, ids = torch.randn(2, 3, 1, 4), torch.arange(6).view(2, 3)
    (qh, idh), landed = hostcopy.to_host(CPU, q, ids)
    assert qh is q and idh is ids and landed is None
