"""Decode's native CPU kernels: the matmul (probes/gemv.c through kvbench.kernels.cpu.gemv),
x @ W^T equal to a float64 reference for every batch it takes, under every instruction set,
on one and several threads; where it applies; the decode batches' weight layout that uses
it; the RMSNorm (probes/norm.c) against torch's and where the decoder uses it; and the
cold-KV prefetch setting of decode runs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbench.kernels import cpu  # noqa: E402
from kvbench.models.linear import Linear, matmul, packed  # noqa: E402

needs_native = pytest.mark.skipif(cpu._lib() is None, reason="native library not built")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize(("n", "k"), [(7, 16), (13, 20), (29, 40), (31, 48), (200, 64), (33, 80),
                                      (1031, 576), (37, 2056), (37, 3080)])
@pytest.mark.parametrize("threads", [1, 3])
def test_gemv_matches_the_reference(isa: str, rows: int, n: int, k: int,
                                    threads: int) -> None:
    """Every row count 1..8 (each has its own register block), N not a multiple of the
    thread split, K a multiple of the vector width but not of the unrolled step (40, 48,
    80: the vector tails; 40 takes AVX2 under avx512) and not of the width at all (20: the
    portable loop); x's rows past 48 KiB (K 2056 at 6-8 rows, 3080 at 4-8: AVX2 interleaves
    them first, 3080 with a tail past the unrolled step)."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(2, rows, k, generator=g)[1]  # a view into a larger buffer
    got = cpu.gemv(x, w, threads)
    ref = (x.double() @ w.double().t()).float()
    assert got.shape == (rows, n)
    # float32 to 1e-5 per 64 terms summed (sums of K products of unit normals)
    tol = 1e-5 * max(1.0, k / 64) ** 0.5
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@needs_native
def test_gemv_keeps_the_leading_dimensions() -> None:
    w, x = torch.randn(33, 24), torch.randn(2, 1, 24)
    torch.testing.assert_close(cpu.gemv(x, w), (x @ w.t()), rtol=1e-5, atol=1e-5)


@needs_native
def test_where_gemv_applies() -> None:
    w = torch.randn(16, 8)
    assert cpu.gemv_ok(torch.randn(8, 8), w)
    assert not cpu.gemv_ok(torch.randn(9, 8), w)  # more rows than a call takes: prefill
    assert not cpu.gemv_ok(torch.randn(8, 16)[:, :8], w)  # not contiguous
    assert not cpu.gemv_ok(torch.randn(1, 8), w.t().contiguous().t())  # W not row-major
    assert not cpu.gemv_ok(torch.randn(1, 8, dtype=torch.bfloat16), w.bfloat16())
    assert not cpu.gemv_ok(torch.randn(1, 7), w)  # K differs


@needs_native
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_decode_batches_read_the_weight_as_it_is_and_prefill_falls_back(batch: int) -> None:
    """At batch 1 to 8 the layout is the weight itself ("native": no copy, whether or not
    memory is spare); more rows than the kernel takes (a prefill) go through F.linear; the
    bias is added either way."""
    lin = Linear(24, 40)
    before = lin.weight.data_ptr()
    lin.pack(batch, spare=False)
    assert lin.fast is not None and lin.fast[1] == "native"
    assert lin.weight.data_ptr() == before == lin.fast[0].data_ptr()
    for x in (torch.randn(batch, 1, 24), torch.randn(1, 12, 24)):
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-5)
    head = packed(torch.randn(40, 24), batch, spare=False)
    assert head is not None and head[1] == "native"
    x = torch.randn(batch, 24)
    torch.testing.assert_close(matmul(x, head, None), x @ head[0].t(), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_more_rows_than_the_kernel_takes_pack_for_onednn_where_memory_allows() -> None:
    w = torch.randn(40, 24)
    assert packed(w, cpu.MAX_GEMV_ROWS + 1, spare=False) is None  # F.linear
    p = packed(w, cpu.MAX_GEMV_ROWS + 1, spare=True)
    assert p is not None and p[1] == "dnn"
    x = torch.randn(cpu.MAX_GEMV_ROWS + 1, 24)
    torch.testing.assert_close(matmul(x, p, None), x @ w.t(), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("shape", [(1, 1, 576), (4, 1, 576), (3, 13), (64, 40)])
def test_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    """Rows of a decode step and odd widths (the loop's scalar tail), large and small values."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    w = torch.randn(shape[-1], generator=g)
    ref = torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-5)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-6)


@needs_native
def test_where_rms_norm_applies_and_the_decoder_uses_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.models.decoder import RMSNorm

    w = torch.randn(8)
    assert cpu.rms_norm_ok(torch.randn(cpu.MAX_NORM_ROWS, 8), w)
    assert not cpu.rms_norm_ok(torch.randn(cpu.MAX_NORM_ROWS + 1, 8), w)  # a prefill
    assert not cpu.rms_norm_ok(torch.randn(4, 16)[:, :8], w)  # not contiguous
    assert not cpu.rms_norm_ok(torch.randn(4, 8).bfloat16(), w)
    assert not cpu.rms_norm_ok(torch.randn(4, 7), w)
    norm = RMSNorm(8, 1e-6)
    calls: list[int] = []
    native = cpu.rms_norm
    monkeypatch.setattr(cpu, "rms_norm", lambda x, w, eps: calls.append(1) or native(x, w, eps))
    decode, prefill = torch.randn(4, 1, 8), torch.randn(1, 100, 8)
    for x in (decode, prefill):
        ref = torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-6)
        torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-6)
    assert calls == [1]  # the decode rows only


@needs_native
def test_cold_kv_prefetches_every_dense_call_and_restores_the_default() -> None:
    """Inside a decode run every dense call prefetches (kvbench.kernels.cpu.cold_kv); the
    default (half the LLC, for probes' repeated calls) comes back after, also on error."""
    before = cpu.prefetch_from()
    with cpu.cold_kv():
        assert cpu.prefetch_from() == 0
    assert cpu.prefetch_from() == before
    with pytest.raises(RuntimeError), cpu.cold_kv():
        raise RuntimeError("a step failed")
    assert cpu.prefetch_from() == before
