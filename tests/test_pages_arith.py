"""The page machinery's arithmetic (kvbench.strategies._pages), each figure by hand in
float64: digests, scores, selection, token positions, the selected attention and its
counts, the option checks' messages (issue 30: the mutation run's page module)."""

from __future__ import annotations

import pytest
import torch

from kvbench.errors import KvbenchError
from kvbench.runtime.context import Counters
from kvbench.strategies._pages import (
    Digests,
    _torch_selected,
    attend_selected,
    check_layers,
    check_pages,
    digest,
    kept_pages,
    page_scores,
    page_tokens,
    select_pages,
    select_positions,
)


def test_digest_minmax_and_cuboid_mean_by_hand() -> None:
    k = torch.tensor([[1.0, -2.0], [3.0, 0.0], [2.0, 4.0]])  # one page, n=3, D=2
    lo, hi = digest(k, "minmax")
    assert lo.tolist() == [1.0, -2.0] and hi.tolist() == [3.0, 4.0]
    # centre (2, 1); radius mean |k - c|: (1+1+0)/3, (3+1+3)/3
    lo, hi = digest(k.double(), "cuboid-mean")
    assert lo.dtype == torch.float32
    assert lo.tolist() == pytest.approx([2 - 2 / 3, 1 - 7 / 3], rel=1e-6)
    assert hi.tolist() == pytest.approx([2 + 2 / 3, 1 + 7 / 3], rel=1e-6)


def test_digests_update_whole_and_partial_pages_and_count_bytes() -> None:
    torch.manual_seed(0)
    k = torch.randn(2, 1, 11, 3)  # pages of 4: [0..3], [4..7], [8..10] partial
    d = Digests(2, 1, 12, 3, 4, "minmax", torch.device("cpu"), torch.float32)
    assert d.lo.shape == (2, 1, 3, 3)
    d.update(k, 0, 6)  # page 0 whole, page 1 partial (4..5)
    assert torch.equal(d.hi[:, :, 0], k[:, :, 0:4].amax(-2))
    assert torch.equal(d.lo[:, :, 1], k[:, :, 4:6].amin(-2))
    d.update(k, 6, 11)  # page 1 re-digested whole, page 2 partial (8..10)
    assert torch.equal(d.hi[:, :, 1], k[:, :, 4:8].amax(-2))
    assert torch.equal(d.lo[:, :, 2], k[:, :, 8:11].amin(-2))
    assert torch.equal(d.hi[:, :, 0], k[:, :, 0:4].amax(-2))  # untouched
    assert d.nbytes(9) == 2 * 2 * 1 * 3 * 3 * 4  # 3 pages cover 9 tokens
    assert d.nbytes(8) == 2 * 2 * 1 * 2 * 3 * 4
    half = Digests(1, 2, 5, 4, 2, "cuboid-mean", torch.device("cpu"), torch.float16)
    assert half.lo.shape == (1, 2, 3, 4) and half.nbytes(1) == 2 * 2 * 4 * 2
    made = []
    Digests(1, 1, 4, 2, 2, "minmax", torch.device("cpu"), torch.float32,
            alloc=lambda shape: made.append(shape) or torch.zeros(shape))
    assert made == [(1, 1, 2, 2)] * 2
    with pytest.raises(KvbenchError, match="digest 'mean': one of minmax, cuboid-mean"):
        Digests(1, 1, 4, 2, 2, "mean", torch.device("cpu"), torch.float32)


def test_page_scores_are_the_box_bound_per_head_and_per_group() -> None:
    torch.manual_seed(1)
    q = torch.randn(2, 4, 1, 3)  # Hq = 4 over Hkv = 2: groups of 2
    lo = torch.randn(2, 2, 5, 3)
    hi = lo + torch.rand(2, 2, 5, 3)
    want = torch.zeros(2, 4, 5, dtype=torch.float64)
    for b in range(2):
        for h in range(4):
            for p in range(5):
                want[b, h, p] = sum(max(float(q[b, h, 0, i] * hi[b, h // 2, p, i]),
                                        float(q[b, h, 0, i] * lo[b, h // 2, p, i]))
                                    for i in range(3))
    per_query = page_scores(q, lo, hi, "query")
    assert per_query.shape == (2, 4, 5)
    assert torch.allclose(per_query.double(), want, rtol=1e-5, atol=1e-6)
    per_kv = page_scores(q, lo, hi, "kv")
    assert per_kv.shape == (2, 2, 5)
    assert torch.allclose(per_kv.double(), want.view(2, 2, 2, 5).sum(2), rtol=1e-5, atol=1e-6)


def test_select_pages_keeps_sinks_window_and_the_top() -> None:
    scores = torch.tensor([[[0.0, 9.0, 1.0, 8.0, 2.0, 7.0, 3.0, -1.0]]])
    # 7 pages (the 8th ignored), k = 4, 1 sink (page 0), window 2 (pages 5, 6): + the top one
    assert select_pages(scores, 7, 4, 1, 2).tolist() == [[[0, 1, 5, 6]]]
    assert select_pages(scores, 7, 5, 0, 1).tolist() == [[[1, 3, 4, 5, 6]]]
    assert select_pages(scores, 7, 3, 2, 1).tolist() == [[[0, 1, 6]]]
    assert select_pages(scores, 4, 4, 1, 1).tolist() == [[[0, 1, 2, 3]]]  # k >= pages: all
    assert select_pages(scores, 3, 9, 0, 1).tolist() == [[[0, 1, 2]]]
    assert select_pages(scores, 2, 1, 0, 5).tolist() == [[[0]]]  # window past the start
    assert scores[0, 0, 0] == 0.0  # the caller's scores untouched


@pytest.mark.parametrize("native", [True, False])
def test_select_positions_by_hand(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of 2, n = 7 (page 3 holds token 6 only), one KV group of two query heads,
    k = 3 pages: sink page 0, window page 3 and the top of the rest by the group's summed
    bound q+ . hi + q- . lo, page 2 (2 x (1 + 9)) over page 1 (2 x (5 - 1)); the same
    positions natively and in torch ops, each path named."""
    from kvbench.kernels import cpu
    from kvbench.kernels.attention import backend_use

    if native:
        assert cpu.native_built()
    else:
        monkeypatch.setattr(cpu, "page_select_ok", lambda *a: False)
    q = torch.tensor([1.0, -1.0]).expand(1, 2, 1, 2).contiguous()  # [B, Hq, 1, D]
    hi = torch.tensor([[0.0, 0.0], [5.0, 0.0], [1.0, 0.0], [3.0, 0.0]])[None, None]
    lo = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, -9.0], [0.0, 0.0]])[None, None]
    backend_use(reset=True)
    pos, lens = select_positions(q, lo, hi, 4, 3, 1, 1, "kv", 2, 7)
    assert backend_use() == {"decode": "native-select" if native else "torch-select"}
    assert pos.tolist() == [[[0, 1, 4, 5, 6, 0]]] and lens.tolist() == [[5]]
    heads, lens = select_positions(q, lo, hi, 4, 3, 1, 1, "query", 2, 7)  # a row a head
    assert heads.tolist() == [[pos[0, 0].tolist()] * 2] and lens.tolist() == [[5, 5]]


def test_kept_pages_is_the_selections_width() -> None:
    """kept_pages is select_pages' K' (the pages every row of a selection holds: Quest's
    kernel path, the PNM device's mask): the budget's pages, or every page of a shorter
    context."""
    scores = torch.randn(2, 3, 10)
    for n in (1, 8, 9, 31, 33, 80):
        n_pages = -(-n // 8)
        pages = select_pages(scores, n_pages, 4, 1, 1)
        assert pages.shape[-1] == kept_pages(32, 8, n) == min(4, n_pages)
        assert kept_pages(39, 8, n) == min(4, n_pages)  # whole pages of the budget


def test_page_tokens_positions_and_lengths() -> None:
    """Whole pages in their order, then the partial page, then the pages past the end."""
    pages = torch.tensor([[[0, 2, 3], [3, 1, 4], [5, 2, 0]]])  # page 3 partial (n = 11)
    pos, lens = page_tokens(pages, 3, 11)
    assert pos.tolist() == [[[0, 1, 2, 6, 7, 8, 9, 10, 0],
                             [3, 4, 5, 9, 10, 0, 0, 0, 0],
                             [6, 7, 8, 0, 1, 2, 0, 0, 0]]]
    assert lens.tolist() == [[8, 5, 6]]
    pos, lens = page_tokens(pages, 3, 12)  # page 3 whole: only pages 4 and 5 past the end
    assert pos.tolist()[0][1] == [9, 10, 11, 3, 4, 5, 0, 0, 0] and lens.tolist() == [[9, 6, 6]]
    # a page past the end given before the partial one, which holds one token (n = 10)
    pos, lens = page_tokens(torch.tensor([[[4, 3, 1], [3, 4, 0]]]), 3, 10)
    assert pos.tolist() == [[[3, 4, 5, 9, 0, 0, 0, 0, 0], [0, 1, 2, 9, 0, 0, 0, 0, 0]]]
    assert lens.tolist() == [[4, 4]]
    pos, lens = page_tokens(torch.tensor([[[4, 3, 1]]]), 3, 11)  # the partial page holds 2
    assert pos.tolist() == [[[3, 4, 5, 9, 10, 0, 0, 0, 0]]] and lens.tolist() == [[5]]


def test_page_tokens_keeps_the_order_of_many_pages() -> None:
    """Whole pages keep the order they are given in, however many (a stable sort: an
    unstable one reorders rows this long)."""
    pages = torch.randperm(300, generator=torch.Generator().manual_seed(3)).view(1, 1, -1)
    pos, lens = page_tokens(pages, 4, 300 * 4)
    assert torch.equal(pos.view(1, 1, 300, 4)[..., 0] // 4, pages) and lens.tolist() == [[1200]]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
               lens: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention of each query head over its selection's first len keys."""
    b_, hq, _, d = q.shape
    h, hkv = pos.shape[1], k.shape[1]
    out = torch.zeros(b_, hq, 1, d, dtype=torch.float64)
    for b in range(b_):
        for i in range(hq):
            sel = i // (hq // h)
            keys = pos[b, sel, :int(lens[b, sel])]
            kk = k[b, i // (hq // hkv)].double()[keys]
            vv = v[b, i // (hq // hkv)].double()[keys]
            w = torch.softmax(kk @ q[b, i, 0].double() / d ** 0.5, dim=0)
            out[b, i, 0] = w @ vv
    return out


@pytest.mark.parametrize("per_query", [False, True])
def test_attend_selected_matches_float64_and_counts_by_hand(per_query: bool) -> None:
    """Hq 4 over Hkv 2, 10 keys of D 8; selections of 3 and 5 keys (padding after them)."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    h = 4 if per_query else 2
    pos = torch.tensor([[[1, 4, 7, 0, 0], [0, 2, 3, 8, 9]] * (h // 2)])
    lens = torch.tensor([[3, 5] * (h // 2)])
    c = Counters(kv_heads=2, elem_bytes=4)
    out, lse = attend_selected(q, k, v, pos, lens, c)
    assert torch.allclose(out.double(), _reference(q, k, v, pos, lens), atol=1e-5)
    assert lse.shape == (1, 4, 1)
    torch_out, _ = _torch_selected(q, k, v, pos, lens)
    assert torch.allclose(torch_out.double(), _reference(q, k, v, pos, lens), atol=1e-5)
    selected = 8 * (h // 2)  # keys over the selections
    assert c.step_total("tokens", "accel", 0) == pytest.approx(selected / h)
    assert c.step_total("flops", "accel", 0) == pytest.approx(selected * 4.0 * 4 * 8 / h)
    assert c.step_total("bytes_read", "accel", 0) == pytest.approx(selected * 2.0 * 8 * 4)


def test_attend_selected_ignores_nan_padding() -> None:
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    v[0, 0, 5] = float("nan")  # only in a padding slot
    pos, lens = torch.tensor([[[0, 2, 5]]]), torch.tensor([[2]])
    out, _ = _torch_selected(q, k, v, pos, lens)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), _reference(q, k, v, pos, lens), atol=1e-5)
    with pytest.raises(KvbenchError, match="selection of 3 heads for 2 query heads over 1 KV"):
        attend_selected(q, k, v, torch.zeros(1, 3, 2, dtype=torch.long),
                        torch.ones(1, 3, dtype=torch.long), Counters(1, 4))


@pytest.mark.parametrize(("args", "message"), [
    ((0, 64, 0, 1, 0), "--page-size 0: must be at least 1"),
    ((16, 15, 0, 1, 0), "--budget-tokens 15: smaller than one page of 16 tokens"),
    ((16, 64, -1, 1, 0), "--sinks -1 / --window-pages 1: sinks >= 0 and at least the "
                         "current page (window >= 1)"),
    ((16, 64, 0, 0, 0), "--sinks 0 / --window-pages 0: sinks >= 0 and at least the current "
                        "page (window >= 1)"),
    ((16, 64, 2, 3, 0), "--sinks 2 + --window-pages 3 pages exceed the budget of 4 pages"),
    ((16, 64, 0, 1, -1), "--dense-layers -1: must be >= 0"),
])
def test_check_pages_messages(args: tuple, message: str) -> None:
    with pytest.raises(KvbenchError) as e:
        check_pages(*args)
    assert str(e.value) == message


def test_check_pages_edges_pass() -> None:
    check_pages(1, 1, 0, 1, 0)  # one page of one token: the current page only
    check_pages(16, 64, 1, 3, 0, "query")  # sinks + window == the budget's pages
    with pytest.raises(KvbenchError) as e:
        check_pages(16, 64, 0, 1, 0, "head")
    assert str(e.value) == "--topk-per 'head': one of query, kv"
    check_layers(4, 4)
    with pytest.raises(KvbenchError) as e:
        check_layers(5, 4)
    assert str(e.value) == "--dense-layers 5: the model runs 4 layers"


def test_attend_selected_backends_float64_on_torch_float32_native() -> None:
    """float64 tensors take the torch path (the native kernel is float32), and the backend
    each call ran is what the record's method.backend will say."""
    from kvbench.kernels import cpu
    from kvbench.kernels.attention import backend_use

    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    pos, lens = torch.tensor([[[1, 4, 7, 0], [0, 2, 3, 8]]]), torch.tensor([[3, 4]])
    want = _reference(q, k, v, pos, lens)
    backend_use(reset=True)
    out, _ = attend_selected(q.double(), k.double(), v.double(), pos, lens, Counters(2, 8))
    assert out.dtype == torch.float64 and torch.allclose(out, want, atol=1e-12)
    assert backend_use(reset=True) == {"decode": "torch-pages"}
    out, _ = attend_selected(q, k, v.double(), pos, lens, Counters(2, 4))  # mixed: torch
    assert backend_use(reset=True) == {"decode": "torch-pages"}
    if cpu.native_ok(q):
        out, _ = attend_selected(q, k, v, pos, lens, Counters(2, 4))
        assert torch.allclose(out.double(), want, atol=1e-5)
        assert backend_use(reset=True) == {"decode": "native-pages"}


def test_digests_update_page_aligned_and_within_one_page() -> None:
    torch.manual_seed(4)
    k = torch.randn(1, 2, 12, 3)
    d = Digests(1, 2, 12, 3, 4, "minmax", torch.device("cpu"), torch.float32)
    d.update(k, 0, 4)  # exactly one whole page: the others untouched
    assert torch.equal(d.lo[:, :, 0], k[:, :, 0:4].amin(-2))
    assert not d.lo[:, :, 1:].any() and not d.hi[:, :, 1:].any()
    d.update(k, 4, 6)  # page 1 partial
    d.update(k, 6, 7)  # still within page 1: no whole page
    assert torch.equal(d.lo[:, :, 1], k[:, :, 4:7].amin(-2))
    d.update(k, 7, 12)  # pages 1 and 2 whole
    for p in range(3):
        assert torch.equal(d.lo[:, :, p], k[:, :, 4 * p:4 * p + 4].amin(-2))
        assert torch.equal(d.hi[:, :, p], k[:, :, 4 * p:4 * p + 4].amax(-2))


def test_torch_selected_batch_of_two() -> None:
    torch.manual_seed(8)
    q, k, v = (torch.randn(2, 4, 1, 8, dtype=torch.float64),
               torch.randn(2, 2, 6, 8, dtype=torch.float64),
               torch.randn(2, 2, 6, 8, dtype=torch.float64))
    pos = torch.tensor([[[0, 1, 2], [3, 4, 5]], [[5, 0, 0], [1, 3, 0]]])
    lens = torch.tensor([[3, 3], [1, 2]])
    out, _ = _torch_selected(q, k, v, pos, lens)
    assert torch.allclose(out, _reference(q, k, v, pos, lens), atol=1e-12)
