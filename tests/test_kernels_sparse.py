"""sparse_attention: any split of KV positions into two parts merges to full attention."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_attention import TOL, make, max_err, native_isa, reference

from kvbench.errors import KvbenchError
from kvbench.kernels import dense_attention, merge, pack_indices, sparse_attention
from kvbench.kernels.cpu import output_buffers


def ragged(keep):
    """[B, Hkv, Lk] bool -> nested [B][Hkv] lists of the kept positions."""
    return [[torch.nonzero(row).flatten() for row in head] for head in keep]


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 4]),
       lq=st.sampled_from([1, 3, 32]), lk=st.integers(0, 90), d=st.sampled_from([7, 8, 33, 64, 65]),
       p=st.floats(0, 1), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99),
       task=st.sampled_from([None, 1, 3]), isa=st.sampled_from(["avx512", "avx2", "portable"]))
def test_any_split_merges_to_full(b, hkv, group, lq, lk, d, p, causal, dtype, seed, task, isa):
    q, k, v = make(b, hkv * group, hkv, lq, lk, d, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    part = torch.rand(b, hkv, lk, generator=gen) < p  # per-head random split, may be empty
    with native_isa(isa):  # either inner-loop set of the native kernel
        o1, l1 = sparse_attention(q, k, v, ragged(part), causal=causal, group=task, threads=2)
        o2, l2 = sparse_attention(q, k, v, ragged(~part), causal=causal, group=task,
                                  threads=2)
    out, lse = merge(o1, l1, o2, l2)
    ref, ref_lse = reference(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and lse.dtype == torch.float32
    assert max_err(out, ref) <= TOL[dtype]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.float()))
    # Each part alone is attention restricted to its keys.
    ref1, _ = reference(q, k, v, causal=causal, keep=part)
    assert max_err(o1, ref1) <= TOL[dtype]


@pytest.mark.parametrize("dtype, lq", [(torch.float16, 2), (torch.float32, 40)])
def test_torch_fallback_matches_reference(dtype, lq):
    """float16 and Lq > 32 leave the native kernel; padding (lengths) is never attended."""
    q, k, v = make(1, 4, 2, lq, 60, 16, dtype)
    gen = torch.Generator().manual_seed(lq)
    idx = torch.stack([torch.randperm(60, generator=gen)[:20] for _ in range(2)]).view(1, 2, 20)
    lengths = torch.tensor([[20, 7]])
    out, lse = sparse_attention(q, k, v, idx, lengths=lengths)
    keep = torch.zeros(1, 2, 60, dtype=torch.bool)
    keep[0, 0, idx[0, 0]] = True
    keep[0, 1, idx[0, 1, :7]] = True
    ref, ref_lse = reference(q, k, v, keep=keep)
    assert max_err(out, ref) < (1e-2 if dtype == torch.float16 else 1e-5)
    # a causal row whose kept keys all lie in its future has no keys: lse -inf on both sides
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert max_err(lse[~empty], ref_lse[~empty]) < 1e-3


def test_writes_into_preallocated_buffers():
    q, k, v = make(2, 4, 4, 1, 50, 32)
    out, lse = output_buffers(q)
    idx = torch.arange(50).expand(2, 4, 50)
    res = sparse_attention(q, k, v, idx, out=out, lse=lse)
    assert res[0].data_ptr() == out.data_ptr() and res[1].data_ptr() == lse.data_ptr()
    dense, dense_lse = dense_attention(q, k, v, backend="torch")
    assert max_err(out, dense) < 1e-5 and max_err(lse, dense_lse) < 1e-5


@pytest.mark.parametrize("indices, msg", [
    (torch.zeros(1, 3, 4, dtype=torch.long), r"indices must be \[B=1, Hkv=2"),
    (torch.full((1, 2, 4), 10), r"positions must lie in \[0, 10\)"),
    ([[torch.tensor([0, -1]), torch.tensor([1])]], "positions must lie"),
])
def test_bad_indices(indices, msg):
    q, k, v = make(1, 2, 2, 1, 10, 8)
    with pytest.raises(KvbenchError, match=msg):
        sparse_attention(q, k, v, indices)


def test_packed_selection_is_reused_and_checked():
    q, k, v = make(1, 4, 2, 1, 40, 16)
    keep = torch.rand(1, 2, 40, generator=torch.Generator().manual_seed(3)) < 0.3
    sel = pack_indices(ragged(keep), 1, 2, 40)
    assert sel.idx.dtype == torch.int32 and sel.idx.shape[1] == int(sel.lens.max())
    out, _ = sparse_attention(q, k, v, sel)
    assert max_err(out, reference(q, k, v, keep=keep)[0]) < 1e-5
    with pytest.raises(KvbenchError, match="does not fit"):
        sparse_attention(q, k[:, :, :30], v[:, :, :30], sel)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_path_padding_never_reads_nan(device, monkeypatch):
    """GPU audit finding 4: on the torch path (every CUDA call) a row shorter than the
    longest gathers its padding from position 0 (nested lists) or from whatever its index
    holds past its length; scout keeps NaN in non-resident blocks and png-kv's pool slots
    are never-written memory. Weight 0 x NaN is NaN: the output must stay finite and equal
    attention over the selected keys alone."""
    from kvbench.kernels import cpu

    monkeypatch.setattr(cpu, "native_ok", lambda q: False)  # the path CUDA takes
    q, k, v = make(2, 4, 2, 1, 30, 16)
    keep = torch.zeros(2, 2, 30, dtype=torch.bool)
    keep[0, 0, 5:25] = True  # the longest row: 20 keys
    keep[0, 1, [3, 9, 17]] = True  # 3 keys, 17 padded slots
    keep[1, 0, 10:14] = True
    keep[1, 1, 29] = True
    kb, vb = k.clone(), v.clone()  # outside every selection: NaN, inf, -inf
    kb[:, :, 0], vb[:, :, 0] = float("nan"), float("nan")
    kb[:, :, 1], vb[:, :, 1] = float("inf"), float("-inf")
    ref, ref_lse = reference(q, k, v, keep=keep)
    q, kb, vb = q.to(device), kb.to(device), vb.to(device)
    nested, _ = sparse_attention(q, kb, vb, ragged(keep))  # padding: position 0 (NaN)
    idx = torch.ones(2, 2, 20, dtype=torch.long)  # padding: position 1 (+-inf)
    lens = keep.sum(-1)
    for b in range(2):
        for h in range(2):
            idx[b, h, :lens[b, h]] = torch.nonzero(keep[b, h]).flatten()
    padded, lse = sparse_attention(q, kb, vb, idx, lengths=lens)
    for out in (nested, padded):
        assert out.device.type == device and bool(torch.isfinite(out).all())
        assert max_err(out.cpu(), ref) < 1e-5
    assert max_err(lse.cpu(), ref_lse) < 1e-4


@pytest.mark.parametrize("path", ["native", "native-portable", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_narrows_a_group_selection_per_query_head(path, dtype, monkeypatch):
    """keep [B, Hq, N] (HGCA's per-head top-k over a KV head's union): each query head
    attends only its own subset of its KV head's selected keys, exactly attention over that
    subset; a head whose subset is empty has no keys (lse -inf); padding past a row's length
    is never attended whatever keep says there; idx and keep may be column views of wider
    buffers."""
    from kvbench.kernels import cpu

    if path == "torch":
        monkeypatch.setattr(cpu, "native_ok", lambda q: False)
    b, hq, hkv, lk = 2, 6, 2, 150  # 150 keys: blocks of 64 with a tail
    q, k, v = make(b, hq, hkv, 1, lk, 33 if path == "native-portable" else 32, dtype, 5)
    gen = torch.Generator().manual_seed(5)
    union = torch.rand(b, hkv, lk, generator=gen) < 0.7
    mine = torch.rand(b, hq, lk, generator=gen) < 0.6
    mine &= union.repeat_interleave(hq // hkv, dim=1)  # each head's subset of its union
    mine[0, 4] = False  # a query head with nothing selected
    sel = pack_indices(ragged(union), b, hkv, lk)
    n = sel.idx.shape[1]
    keep = torch.ones(b, hq, n, dtype=torch.bool)  # per head, over its row's selection order
    for i in range(b):
        for h in range(hq):
            row = sel.idx[i * hkv + h // (hq // hkv), :int(sel.lens[i * hkv + h // (hq // hkv)])]
            keep[i, h, :len(row)] = mine[i, h, row.long()]
    with native_isa("portable" if path == "native-portable" else "avx2"):
        out, lse = sparse_attention(q, k, v, sel, causal=False, keep=keep)
    kq, vq = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))  # per-head reference
    ref, ref_lse = reference(q, kq, vq, causal=False, keep=mine)
    some = mine.any(-1)
    assert max_err(out[some], ref[some]) <= TOL[dtype]
    assert max_err(lse[some], ref_lse[some].float()) < 1e-3
    assert bool(torch.isneginf(lse[0, 4]).all()) and not bool(torch.isneginf(lse[0, 3]).any())
    with pytest.raises(KvbenchError, match="keep must be bool"):
        sparse_attention(q, k, v, sel, keep=keep[:, :, 1:])
    # the same selection and mask as the first n columns of wider buffers (hgca's KV_ctx
    # tables) with garbage past them: the same result, and on the native kernel no copy
    from kvbench.kernels.sparse import Selection
    from kvbench.runtime.opcount import Counting

    wide_idx = torch.full((sel.idx.shape[0], n + 5), 10**6, dtype=torch.int32)
    wide_idx[:, :n] = sel.idx
    wide_keep = torch.ones(b, hq, n + 5, dtype=torch.bool)
    wide_keep[:, :, :n] = keep
    views = Selection(wide_idx[:, :n], sel.lens, sel.lk)
    with native_isa("portable" if path == "native-portable" else "avx2"), Counting() as c:
        got, got_lse = sparse_attention(q, k, v, views, causal=False, keep=wide_keep[:, :, :n])
    assert torch.equal(got, out) and torch.equal(got_lse, lse)
    assert path == "torch" or "aten.contiguous" not in c.by_op
