"""Quest's page selection in one native call (probes/pages.c through
kvbench.kernels.cpu.page_select) against the torch path it replaces (page_scores,
select_pages, page_tokens of kvbench.strategies._pages), per KV head and per query head,
with sinks, a window, a partial last page and digests that are views of larger buffers
(k at least sinks + window, as the strategies check: beyond it the tie among forced pages
is arbitrary in both)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_kernels_attention import native_isa  # noqa: E402

from kvbench.kernels import cpu  # noqa: E402
from kvbench.strategies._pages import page_scores, page_tokens, select_pages  # noqa: E402

needs_native = pytest.mark.skipif(cpu._lib() is None, reason="native library not built")


@needs_native
@pytest.mark.parametrize("per", ["kv", "query"])
@pytest.mark.parametrize(("n", "k", "sinks", "window"), [(1000, 8, 1, 2), (1003, 5, 0, 1),
                                                         (97, 6, 2, 3), (4096, 32, 1, 1)])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("isa", "d"), [("avx512", 32), ("avx2", 32), ("avx2", 36),
                                        ("portable", 32)])
def test_native_selection_equals_the_torch_path(per: str, n: int, k: int, sinks: int,
                                                window: int, threads: int, isa: str,
                                                d: int) -> None:
    """The scores in each instruction set's loops (d 36: AVX2's eight channels, not
    AVX-512's sixteen)."""
    page, b, hq, hkv = 16, 2, 6, 2
    g = torch.Generator().manual_seed(n + k + sinks)
    n_pages = -(-n // page)
    lo_buf = torch.randn(b, hkv, n_pages + 7, d, generator=g)  # a preallocated P_max
    hi_buf = lo_buf + torch.rand(b, hkv, n_pages + 7, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    lo, hi = lo_buf[:, :, :n_pages], hi_buf[:, :, :n_pages]
    ref_pos, ref_lens = page_tokens(select_pages(page_scores(q, lo, hi, per), n_pages, k,
                                                 sinks, window), page, n)
    with native_isa(isa):
        pos, lens = cpu.page_select(q, lo, hi, n_pages, k, sinks, window, per, page, n,
                                    threads)
    assert pos.dtype == lens.dtype == torch.int32
    assert torch.equal(lens.long(), ref_lens.long())
    assert torch.equal(pos.long(), ref_pos.long())  # the tails are 0 in both


@needs_native
def test_where_native_selection_applies() -> None:
    q, lo = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    assert cpu.page_select_ok(q, lo, lo + 1)
    assert not cpu.page_select_ok(torch.randn(1, 4, 2, 8), lo, lo)  # two queries: append
    assert not cpu.page_select_ok(q.bfloat16(), lo.bfloat16(), lo.bfloat16())
    assert not cpu.page_select_ok(q, lo, torch.randn(1, 2, 9, 8)[:, :, :5])  # strides differ


@needs_native
@pytest.mark.parametrize("page", [1, 7, 16])
def test_a_decoded_token_updates_the_digests_as_recomputing_its_page(page: int) -> None:
    """Digests.update of one token (one native call, probes/pages.c: a page's first token
    sets lo = hi, a later one takes min/max) equals amin/amax over the page's tokens so far,
    bit for bit, on a key buffer and digests that are views with padded strides; it
    dispatches no torch op."""
    from kvbench.runtime.opcount import Counting
    from kvbench.strategies._pages import Digests

    g = torch.Generator().manual_seed(page)
    keys = torch.randn(3, 2, 90, 24, generator=g)[:, :, :, :20]  # channels strided
    got = Digests(3, 2, 90, 20, page, "minmax", torch.device("cpu"), torch.float32)
    got.update(keys, 0, 40)  # a prefill's pages
    for n in range(40, 90):
        with Counting() as c:
            got.update(keys, n, n + 1)
        assert sum(c.by_op.values()) == 0
        p = n // page
        span = keys[:, :, p * page:n + 1]
        assert torch.equal(got.lo[:, :, p], span.amin(-2))
        assert torch.equal(got.hi[:, :, p], span.amax(-2))
