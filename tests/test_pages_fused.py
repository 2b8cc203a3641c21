"""The page-sparse strategies' decode path (strategies/_pages.py, issue 26): the native kernel
that attends every head's selected pages in one call equals the torch path and a float64
loop; selection and attention make no device-to-host sync and a number of dispatched torch
ops that does not grow with heads or pages; counters take tensors and settle at the step's end.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_kernels_attention import TOL, max_err, native_isa
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench.errors import KvbenchError
from kvbench.kernels import cpu
from kvbench.kernels.attention import backend_use
from kvbench.runtime.context import Counters
from kvbench.strategies._pages import (
    _torch_selected,
    attend_selected,
    page_scores,
    page_tokens,
    select_pages,
)

native = pytest.mark.skipif(cpu.isa() is None, reason="native kernel not built")


class Dispatched(TorchDispatchMode):
    """Every aten op dispatched inside the block; a read of a tensor's value by the host
    (`.item()`, `float(t)`, `bool(t)`: aten::_local_scalar_dense), which on a GPU waits for
    the device, fails at once."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # nothing compiled here: no 5 s torch._dynamo import
        return False

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        name = func._schema.name
        if name in ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::item"):
            raise AssertionError(f"device-to-host sync in a decode step: {name}")
        self.ops.append(name)
        return func(*args, **(kwargs or {}))


def selection(b: int, hq: int, hkv: int, n: int, d: int, page: int, k_pages: int, per: str,
              dtype: torch.dtype, seed: int):
    """q, k, v and one decode step's page selection (top pages by the min/max bound, the
    last page partial when page does not divide n) as page_tokens gives it."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    n_pages = -(-n // page)
    kp = torch.nn.functional.pad(k.float(), (0, 0, 0, n_pages * page - n))
    kp = kp.view(b, hkv, n_pages, page, d)
    pad = torch.arange(n_pages * page).view(n_pages, page, 1) >= n
    lo = kp.masked_fill(pad, float("inf")).amin(-2)
    hi = kp.masked_fill(pad, float("-inf")).amax(-2)
    pages = select_pages(page_scores(q, lo, hi, per), n_pages, k_pages, 1, 1)
    pos, lens = page_tokens(pages, page, n)
    return q, k, v, pos, lens


def loop_reference(q, k, v, pos, lens):
    """Float64 attention, one (sequence, query head) at a time over its first lens keys."""
    b, hq, _, d = q.shape
    h, g = pos.shape[1], hq // k.shape[1]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    lse = torch.zeros(b, hq, dtype=torch.float64)
    for i in range(b):
        for x in range(hq):
            row = x if h == hq else x // g
            keys = pos[i, row, :int(lens[i, row])]
            s = k[i, x // g, keys].double() @ q[i, x, 0].double() * d ** -0.5
            out[i, x] = torch.softmax(s, 0) @ v[i, x // g, keys].double()
            lse[i, x] = torch.logsumexp(s, 0)
    return out, lse


@native
@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [7, 33, 64])
@pytest.mark.parametrize("per", ["kv", "query"])
def test_native_pages_equal_torch_path(per: str, d: int, dtype: torch.dtype, isa: str) -> None:
    """Random GQA shapes, partial last page (lengths below K * S), per KV group and per
    query head: the native call equals the torch path (fp32 to 1e-5, bf16 to its
    tolerance) and both equal a float64 loop; each notes its backend."""
    seed = d + 3 * (per == "kv")
    gen = torch.Generator().manual_seed(seed)
    b, hkv = int(torch.randint(1, 3, (1,), generator=gen)), int(torch.randint(1, 4, (1,),
                                                                               generator=gen))
    hq = hkv * int(torch.randint(1, 5, (1,), generator=gen))
    n = int(torch.randint(70, 200, (1,), generator=gen))
    q, k, v, pos, lens = selection(b, hq, hkv, n, d, 16, 4, per, dtype, seed)
    assert int(lens.min()) < pos.shape[-1]  # the partial page's tail is padding
    backend_use(reset=True)
    with native_isa(isa):
        out, lse = attend_selected(q, k, v, pos, lens, Counters(hkv, dtype.itemsize))
    assert backend_use(reset=True) == {"decode": "native-pages"}
    ref, ref_lse = _torch_selected(q, k, v, pos, lens)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, hq, 1)
    assert max_err(out, ref) <= TOL[dtype]
    assert max_err(lse, ref_lse) <= 1e-5 * (1 + float(ref_lse.abs().max()))
    exact, exact_lse = loop_reference(q, k, v, pos, lens)
    assert max_err(ref[:, :, 0], exact) <= TOL[dtype]
    assert max_err(lse[:, :, 0], exact_lse) <= 1e-4


@native
@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_pages_split_rows(dtype: torch.dtype, isa: str) -> None:
    """Few rows over many selected keys (2 query-head rows, 40 pages): the kernel splits each
    row's keys across threads and merges them; still the torch path's result."""
    q, k, v, pos, lens = selection(1, 2, 1, 1000, 64, 16, 40, "query", dtype, 5)
    with native_isa(isa):
        out, lse = attend_selected(q, k, v, pos, lens, Counters(1, dtype.itemsize))
    ref, ref_lse = _torch_selected(q, k, v, pos, lens)
    assert max_err(out, ref) <= TOL[dtype]
    assert max_err(lse, ref_lse) <= 1e-4


def test_torch_path_off_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native kernel cannot run, attend_selected takes the torch path and says
    so (backend torch-pages); a NaN at the position the padding slots gather (0, never
    selected here) does not reach the output."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 8, generator=gen)
    k, v = torch.randn(2, 2, 2, 40, 8, generator=gen)
    k[:, :, 0], v[:, :, 0] = float("nan"), float("nan")
    pos = torch.stack([torch.randperm(39, generator=gen)[:6] + 1 for _ in range(8)])
    lens = torch.tensor([[6, 3, 4, 1], [2, 6, 5, 6]])
    pos = pos.view(2, 4, 6).masked_fill(torch.arange(6) >= lens.unsqueeze(-1), 0)
    monkeypatch.setattr(cpu, "native_ok", lambda q: False)
    backend_use(reset=True)
    out, lse = attend_selected(q, k, v, pos, lens, Counters(2, 4))
    assert backend_use(reset=True) == {"decode": "torch-pages"}
    exact, exact_lse = loop_reference(q, k, v, pos, lens)
    assert max_err(out[:, :, 0], exact) <= 1e-5
    assert max_err(lse[:, :, 0], exact_lse) <= 1e-5


@pytest.mark.parametrize("per", ["kv", "query"])
@pytest.mark.parametrize("fused", [True, False])
def test_decode_path_no_sync_and_bounded_ops(per: str, fused: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """page_scores -> select_pages -> page_tokens -> attend_selected read no tensor value
    on the host and dispatch as many torch ops at 2 heads over 8 pages as at 16 query heads
    (4 KV heads) over 40 pages: no Python loop over heads, groups or pages."""
    if fused and cpu.isa() is None:
        pytest.skip("native kernel not built")
    if not fused:
        monkeypatch.setattr(cpu, "native_ok", lambda q: False)
    counts = []
    for hq, hkv, n in [(2, 1, 8 * 16 - 5), (16, 4, 40 * 16 - 5)]:
        gen = torch.Generator().manual_seed(hq)
        q = torch.randn(2, hq, 1, 8, generator=gen)
        k, v = torch.randn(2, 2, hkv, n, 8, generator=gen)
        lo = hi = torch.randn(2, hkv, -(-n // 16), 8, generator=gen)
        counters = Counters(hkv, 4)
        counters.step = 1
        with Dispatched() as seen:
            scores = page_scores(q, lo, hi.abs() + lo, per)
            pages = select_pages(scores, lo.shape[2], 4, 1, 1)
            pos, lens = page_tokens(pages, 16, n)
            attend_selected(q, k, v, pos, lens, counters)
        counts.append(len(seen.ops))
        counters.step_end(0.0)  # the counts are read here, once
        tokens = next(s for qn, _, _, s in counters.series() if qn == "tokens")
        assert tokens == {1: pytest.approx(float(lens.sum()) / pos.shape[1])}
    assert counts[0] == counts[1], counts


def test_counters_take_tensors_and_settle_once() -> None:
    """Tensor adds dispatch nothing in the step; their sums (times `scale`) become floats at
    step_end, in the series and in the stage graph's tasks."""
    c = Counters(2, 4)
    c.step = 3
    lens, nbytes, more = torch.tensor([[5, 1], [2, 0]]), torch.tensor(100.0), torch.tensor([1.5])
    with Dispatched() as seen:
        c.add("tokens", "accel", lens, 0.5)
        c.add("bytes_read", "accel", nbytes)
        c.add("bytes_read", "accel", 7.0)
        c.add("bytes_read", "accel", more, 2.0)
    assert seen.ops == []
    c.step_end(0.0)
    series = {(qn, w): s for qn, w, _, s in c.series()}
    assert series == {("tokens", "accel"): {3: 4.0}, ("bytes_read", "accel"): {3: 110.0}}
    assert all(type(x) is float for s in series.values() for x in s.values())
    work = [t.work for t in c.graph.tasks if t.op == "compute"]
    assert work == [{"bytes_read": 110.0, "launches": 0.0}]


@native
def test_selection_rows_must_fit_the_heads() -> None:
    """kvb_attn's selection rows per sequence must lie between Hkv and Hq (dividing)."""
    q, k, v = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    idx, lens = torch.zeros(4, 5, dtype=torch.int32), torch.full((4,), 5, dtype=torch.int32)
    with pytest.raises(KvbenchError, match="selection rows"):
        cpu.run(q, k, v, scale=1.0, causal=False, q_start=0, idx=idx, lens=lens, heads=4)
