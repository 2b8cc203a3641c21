"""dense_attention and merge against a float64 reference; property tests over splits."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.errors import KvbenchError
from kvbench.kernels import dense_attention, merge

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(q, k, v, causal=True, q_start=None, keep=None):
    """Float64 softmax attention; `keep` [B, Hkv, Lk] bool restricts the keys (sparse)."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(d)
    start = lk - lq if q_start is None else q_start
    mask = torch.zeros(b, hq, lq, lk, dtype=torch.bool)
    if causal:
        mask |= torch.arange(lk)[None, :] > (start + torch.arange(lq))[:, None]
    if keep is not None:
        mask |= ~keep.repeat_interleave(g, dim=1)[:, :, None, :]
    s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isinf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    return p @ vv, lse


def make(b, hq, hkv, lq, lk, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    return q, k, v


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@contextlib.contextmanager
def native_isa(name: str):
    """The native kernel's inner loops set to `name` (portable, or avx2 where the CPU has
    it; the portable ones elsewhere) for the block, the previous set restored after; a
    no-op where the kernel is not built."""
    from kvbench.kernels import cpu

    before = cpu.isa()
    if before is None:
        yield
        return
    cpu.isa(name)
    try:
        yield
    finally:
        cpu.isa(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq", [1, 7, 32])
def test_dense_matches_reference(dtype, lq):
    q, k, v = make(2, 8, 2, lq, 67, 32, dtype)
    out, lse = dense_attention(q, k, v)
    ref, ref_lse = reference(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert max_err(out, ref) < TOL[dtype]
    assert max_err(lse, ref_lse) < 1e-4


def test_prefill_chunks_and_non_causal(monkeypatch):
    from kvbench.kernels import attention

    q, k, v = make(1, 4, 4, 40, 40, 16)
    monkeypatch.setattr(attention, "_MAX_SCORES", 4 * 40 * 3)  # chunks of 3 queries
    out, lse = dense_attention(q, k, v)
    ref, ref_lse = reference(q, k, v)
    assert max_err(out, ref) < 1e-5 and max_err(lse, ref_lse) < 1e-5
    out, _ = dense_attention(q, k, v, causal=False)
    assert max_err(out, reference(q, k, v, causal=False)[0]) < 1e-5


def test_empty_kv_and_masked_queries():
    q, k, v = make(1, 2, 1, 3, 0, 8)
    out, lse = dense_attention(q, k, v)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    # Queries before every key (q_start negative) attend to nothing.
    q, k, v = make(1, 2, 1, 3, 4, 8)
    out, lse = dense_attention(q, k, v, q_start=-2)
    assert torch.all(out[:, :, :2] == 0) and torch.all(torch.isneginf(lse[:, :, :2]))
    assert torch.isfinite(lse[:, :, 2]).all()


@pytest.mark.parametrize("bad, msg", [
    (((1, 6, 1, 8), (1, 4, 5, 8)), "multiple of KV heads"),
    (((1, 4, 1, 8), (1, 4, 5, 16)), "batch or head dimension"),
])
def test_bad_shapes(bad, msg):
    qs, ks = bad
    with pytest.raises(KvbenchError, match=msg):
        dense_attention(torch.randn(qs), torch.randn(ks), torch.randn(ks))


def test_merge_with_empty_parts():
    q, k, v = make(1, 2, 2, 1, 9, 8)
    o, lse = dense_attention(q, k, v)
    e_out, e_lse = dense_attention(q, k[:, :, :0], v[:, :, :0])
    for parts in ((o, lse, e_out, e_lse), (e_out, e_lse, o, lse)):
        mo, mlse = merge(*parts)
        assert max_err(mo, o) == 0 and torch.equal(mlse, lse)
    mo, mlse = merge(e_out, e_lse, e_out, e_lse)
    assert torch.all(mo == 0) and torch.all(torch.isneginf(mlse))


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 4]),
       lq=st.sampled_from([1, 2, 5, 32]), lk=st.integers(0, 80), d=st.sampled_from([8, 64]),
       frac=st.floats(0, 1), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99),
       backend=st.sampled_from(["auto", "torch"]),
       isa=st.sampled_from(["avx512", "avx2", "portable"]))
def test_contiguous_split_merges_to_full(b, hkv, group, lq, lk, d, frac, causal, dtype, seed,
                                         backend, isa):
    """Old keys [0, s) and recent keys [s, Lk) attended apart then merged == full attention
    (the native kernel under either inner-loop set)."""
    q, k, v = make(b, hkv * group, hkv, lq, lk, d, dtype, seed)
    s = round(frac * lk)
    start = lk - lq
    with native_isa(isa):
        o1, l1 = dense_attention(q, k[:, :, :s], v[:, :, :s], causal=causal, q_start=start,
                                 backend=backend)
        o2, l2 = dense_attention(q, k[:, :, s:], v[:, :, s:], causal=causal,
                                 q_start=start - s, backend=backend)
    out, lse = merge(o1, l1, o2, l2)
    ref, ref_lse = reference(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert max_err(out, ref) <= TOL[dtype]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.float()))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert max_err(lse[finite], ref_lse[finite]) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_cuda_matches_cpu(dtype):
    q, k, v = make(2, 8, 2, 32, 300, 64, dtype)
    out, lse = dense_attention(q.cuda(), k.cuda(), v.cuda())
    ref, ref_lse = reference(q, k, v)
    assert out.is_cuda and max_err(out.cpu(), ref) < TOL.get(dtype, 2e-2)
    assert max_err(lse.cpu(), ref_lse) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq, q_start, causal", [(1, None, True), (32, None, True),
                                                 (4, 10, True), (3, -1, True), (8, None, False)])
def test_native_matches_reference(dtype, lq, q_start, causal):
    """The native CPU kernel (probes/attn.c), on strided KV (a preallocated cache's view)."""
    from kvbench.kernels import cpu

    if not cpu.native_ok(torch.empty(1, 1, 1, 1)):
        pytest.skip("native library not built")
    q, k, v = make(2, 6, 3, lq, 150, 40, dtype)
    cache_k = torch.zeros(2, 3, 200, 40, dtype=dtype)
    cache_v = torch.zeros(2, 3, 200, 40, dtype=dtype)
    cache_k[:, :, :150], cache_v[:, :, :150] = k, v
    out, lse = dense_attention(q, cache_k[:, :, :150], cache_v[:, :, :150], causal=causal,
                               q_start=q_start, backend="native", threads=3)
    ref, ref_lse = reference(q, k, v, causal=causal, q_start=q_start)
    assert out.dtype == dtype and max_err(out, ref) < TOL[dtype] / 2
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.float()))
    fin = torch.isfinite(ref_lse)
    assert max_err(lse[fin], ref_lse[fin]) < 1e-4


@pytest.fixture(params=["avx512", "avx2", "portable"])
def kernel_isa(request):
    """Each native inner-loop set in turn (avx2 runs where the CPU has it), restored after."""
    from kvbench.kernels import cpu

    if cpu.isa() is None:
        pytest.skip("native library not built")
    before = cpu.isa()
    got = cpu.isa(request.param)
    if got != request.param:
        cpu.isa(before)
        pytest.skip(f"this CPU has no {request.param}")
    yield got
    cpu.isa(before)


@pytest.fixture(params=["prefetch", "no prefetch"])
def kernel_prefetch(request):
    """Dense calls with rows fetched ahead of use (probes/attn.c) at every KV size, then at
    none; the threshold restored after."""
    from kvbench.kernels import cpu

    if cpu.isa() is None:
        pytest.skip("native library not built")
    before = cpu.prefetch_from()
    cpu.prefetch_from(0 if request.param == "prefetch" else 1 << 62)
    yield request.param
    cpu.prefetch_from(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(8, 8, 64), (9, 3, 64), (4, 4, 128), (9, 3, 128),
                                        (6, 2, 80), (2, 1, 24), (3, 1, 12)])
def test_native_shapes_isas_and_split(kernel_isa, kernel_prefetch, dtype, hq, hkv, d):
    """Both inner-loop sets at MHA and GQA (the bundled model's 9/3), head dims 64/128 and
    ones off the vector width, odd lengths, and long rows that a few threads split along the
    keys (split-K with the log-sum-exp merge), with and without the dense prefetch --
    against the float64 reference."""
    for lk, lq, threads in ((1, 1, 2), (67, 1, 1), (65, 5, 3), (1531, 1, 2), (1531, 3, 3),
                            (2049, 1, 1), (700, 32, 2)):
        q, k, v = make(1, hq, hkv, lq, lk, d, dtype, seed=lk)
        out, lse = dense_attention(q, k * 2, v, backend="native", threads=threads)
        ref, ref_lse = reference(q, k * 2, v)
        assert max_err(out, ref) < TOL[dtype], (lk, lq, threads)
        assert max_err(lse, ref_lse) < 1e-4, (lk, lq, threads)


def test_native_sparse_split_matches_reference(kernel_isa):
    """Long per-head selections on few rows (split-K over the selected positions), with rows
    of different lengths, one of them empty."""
    from kvbench.kernels.sparse import pack_indices, sparse_attention

    q, k, v = make(1, 9, 3, 2, 4000, 64, seed=5)
    gen = torch.Generator().manual_seed(1)
    order = torch.rand(1, 3, 4000, generator=gen).argsort(dim=-1)[..., :1800].sort(-1).values
    lengths = torch.tensor([[1800, 0, 700]])
    keep = torch.zeros(1, 3, 4000, dtype=torch.bool)
    for h in range(3):
        keep[0, h, order[0, h, :lengths[0, h]]] = True
    out, lse = sparse_attention(q, k, v, pack_indices(order, 1, 3, 4000, lengths), threads=2)
    ref, ref_lse = reference(q, k, v, keep=keep)
    assert max_err(out, ref) < 1e-5
    assert torch.all(out[:, 3:6] == 0) and torch.all(torch.isneginf(lse[:, 3:6]))
    fin = torch.isfinite(ref_lse)
    assert max_err(lse[fin], ref_lse[fin]) < 1e-4


def strided(t: torch.Tensor, pad: int) -> torch.Tensor:
    """`t` [B, H, L, D] as a view whose rows lie D + pad elements apart (a wider cache's
    first D columns), filled with NaN between rows: a kernel reading past D returns NaN."""
    b, h, n, d = t.shape
    wide = torch.full((b, h, n, d + pad), float("nan"), dtype=t.dtype)
    wide[..., :d] = t
    view = wide[..., :d]
    assert view.stride(2) == d + pad and view.stride(3) == 1
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [7, 33, 65])
def test_native_head_dims_off_the_vector_width_on_strided_rows(kernel_isa, dtype, d):
    """Issue 30: head dims 7, 33, 65 (not multiples of 4 or 8: every vector loop's tail),
    K and V rows 3 or 13 elements past the head dim apart, dense (one thread and split-K)
    and sparse, each inner-loop set, against the float64 reference."""
    from kvbench.kernels.sparse import pack_indices, sparse_attention

    for lk, lq, threads, pad in ((1, 1, 1, 3), (70, 1, 2, 13), (70, 4, 1, 3), (600, 1, 2, 3)):
        q, k, v = make(2, 6, 3, lq, lk, d, dtype, seed=lk + d)
        ks, vs = strided(k, pad), strided(v, pad + 2)
        out, lse = dense_attention(q, ks, vs, backend="native", threads=threads)
        ref, ref_lse = reference(q, k, v)
        assert max_err(out, ref) < TOL[dtype], (lk, lq, threads)
        assert max_err(lse, ref_lse) < 1e-4, (lk, lq, threads)
        gen = torch.Generator().manual_seed(d)
        n = max(1, lk // 3)
        order = torch.rand(2, 3, lk, generator=gen).argsort(dim=-1)[..., :n].sort(-1).values
        keep = torch.zeros(2, 3, lk, dtype=torch.bool).scatter_(2, order, True)
        out, lse = sparse_attention(q, ks, vs, pack_indices(order, 2, 3, lk), threads=threads)
        ref, ref_lse = reference(q, k, v, keep=keep)
        assert max_err(out, ref) < TOL[dtype], ("sparse", lk, lq, threads)
        fin = torch.isfinite(ref_lse)
        assert max_err(lse[fin], ref_lse[fin]) < 1e-4
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.float()))


@settings(max_examples=25, deadline=None)
@given(isa=st.sampled_from(["avx512", "avx2", "portable"]), b=st.integers(1, 2),
       hkv=st.integers(1, 3), group=st.sampled_from([1, 3]), lq=st.sampled_from([1, 2, 5]),
       lk=st.integers(1, 90), d=st.sampled_from([7, 8, 16, 33, 48, 64, 65, 80, 128]),
       pad=st.integers(0, 9),
       threads=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 99))
def test_native_property_over_every_isa(isa, b, hkv, group, lq, lk, d, pad, threads, dtype,
                                        seed):
    """The native dense kernel over random shapes, head dims and row strides, under each
    inner-loop set, equals the float64 reference."""
    from kvbench.kernels import cpu

    if cpu.isa() is None:
        pytest.skip("native library not built")
    before = cpu.isa()
    try:
        if cpu.isa(isa) != isa:
            pytest.skip(f"this CPU has no {isa}")
        q, k, v = make(b, hkv * group, hkv, lq, lk, d, dtype, seed)
        out, lse = dense_attention(q, strided(k, pad), strided(v, pad), backend="native",
                                   threads=threads)
    finally:
        cpu.isa(before)
    ref, ref_lse = reference(q, k, v)
    assert max_err(out, ref) < TOL[dtype]
    fin = torch.isfinite(ref_lse)
    assert max_err(lse[fin], ref_lse[fin]) < 1e-4


def test_isa_rejects_unknown_name():
    from kvbench.kernels import cpu

    if cpu.isa() is None:
        pytest.skip("native library not built")
    with pytest.raises(KvbenchError, match="unknown kernel instruction set"):
        cpu.isa("sse9")


def cpu_flash(q, k, v, causal, scale):
    """torch's fused flash kernel for the CPU: the shape of the CUDA ones (out, lse)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                      scale=scale)


def test_fused_parts_split_causal_attention_at_the_square_block():
    from kvbench.kernels.attention import fused_parts

    assert fused_parts(1, 67, True, 66) == [(0, 67, False)]  # decode: every key visible
    assert fused_parts(8, 67, False, 59) == [(0, 67, False)]
    assert fused_parts(7, 67, True, 60) == [(0, 60, False), (60, 67, True)]  # append
    assert fused_parts(40, 40, True, 0) == [(0, 40, True)]  # prefill
    assert fused_parts(4, 67, True, 10) == [(0, 10, False), (10, 14, True)]
    assert fused_parts(7, 67, True, 63) is None  # the block would pass the last key
    assert fused_parts(3, 4, True, -2) is None  # queries before the keys


@pytest.mark.parametrize("lq, lk, q_start, causal", [
    (1, 67, None, True), (7, 67, None, True), (40, 40, None, True), (4, 67, 10, True),
    (8, 67, None, False)])
def test_fused_split_and_group_fold_match_reference(lq, lk, q_start, causal):
    """The fused path's decomposition (parts merged by lse, grouped heads folded or run per
    head offset) with a fused kernel that runs here, against the float64 reference."""
    from kvbench.kernels.attention import fused_parts, fused_run

    q, k, v = make(2, 8, 2, lq, lk, 32)
    start = lk - lq if q_start is None else q_start
    parts = fused_parts(lq, lk, causal, start)
    out, lse = fused_run(q, k, v, 32 ** -0.5, parts, cpu_flash)
    ref, ref_lse = reference(q, k, v, causal=causal, q_start=q_start)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert max_err(out, ref) < 1e-5 and max_err(lse, ref_lse) < 1e-4


def test_fused_attention_falls_back_and_remembers_refusals(monkeypatch):
    from kvbench.kernels import attention

    tried = []

    def refuses(q, k, v, causal, scale):
        tried.append(1)
        raise RuntimeError("No available kernel")

    monkeypatch.setattr(attention, "_REFUSED", set())
    monkeypatch.setattr(attention, "FUSED", {"sdpa-flash": refuses, "sdpa-efficient": cpu_flash})
    q, k, v = make(1, 4, 2, 5, 30, 16)
    for _ in range(2):
        out, lse, name = attention.fused_attention(q, k, v, 0.25, True, 25)
        ref, ref_lse = reference(q, k, v)
        assert name == "sdpa-efficient"
        assert max_err(out, ref) < 1e-5 and max_err(lse, ref_lse) < 1e-4
    assert tried == [1] and {("sdpa-flash", torch.float32, 16)} == attention._REFUSED
    monkeypatch.setattr(attention, "FUSED", {"sdpa-flash": refuses})
    assert attention.fused_attention(q, k, v, 0.25, True, 25) is None  # refused: torch path
    assert attention.fused_attention(q, k, v, 0.25, True, 27) is None  # no split: torch path


def test_query_chunks_are_gpu_sized_on_cuda():
    """B=8 x 32 heads x 32K keys: 2 queries a chunk within the CPU's 2^24 scores, 32 within
    CUDA's 2^28 (16x fewer launches for the torch path's prefill there)."""
    from kvbench.kernels.attention import query_chunk

    assert query_chunk(8, 32, 32768, cuda=False) == 2
    assert query_chunk(8, 32, 32768, cuda=True) == 32
    assert query_chunk(64, 64, 1 << 20, cuda=True) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lq, q_start", [(1, None), (32, None), (300, None), (4, 10)])
def test_cuda_fused_attention_matches_reference(dtype, lq, q_start):
    from kvbench.kernels.attention import backend_use

    q, k, v = make(2, 8, 2, lq, 300, 64, dtype)
    backend_use(reset=True)
    out, lse = dense_attention(q.cuda(), k.cuda(), v.cuda(), q_start=q_start)
    used = backend_use(reset=True)
    ref, ref_lse = reference(q, k, v, q_start=q_start)
    assert len(used) == 1 and next(iter(used.values())).startswith("sdpa-"), used
    assert out.dtype == dtype and max_err(out.cpu(), ref) < TOL.get(dtype, 2e-2)
    assert max_err(lse.cpu(), ref_lse) < 1e-2
