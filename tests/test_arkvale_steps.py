"""ArkVale's steps through a whole model (issue 30): what a decode step files per sparse layer
(the completed page backed up, the digests scored, the pages recalled and evicted, the
resident pages and the current one attended), computed in the test from the step's own
counts; a later turn's append (every completed page read back, the cut) exact against full
attention in float32 and bfloat16; the pool always holding the host backup of the pages it
names; the window ring of `_enter`."""

from __future__ import annotations

import pytest
import torch

from kvbench.models import ModelSpec
from kvbench.models.weights import load
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.run import decode_run
from kvbench.strategies.arkvale import ArkVale, ArkValeParams
from kvbench.strategies.full import Full

CPU = torch.device("cpu")
SPEC = ModelSpec("tiny-gqa-4l", "llama", 4, 6, 2, 48, 96, 100, 160, head_dim=20)
B, HQ, HKV, D, S = 3, 6, 2, 20, 8  # batch and KV heads told apart


def _run(params: ArkValeParams | None, prompt: int, steps: int, mode: str = "generate",
         turns: int = 1, dtype: torch.dtype = torch.float32, check=None):
    """(strategy, counters, outcome) of a run on the 4-layer model (None: full attention);
    `check(strategy)` after every decode step."""
    model = load(SPEC, "random", 4, dtype, CPU, seed=5).model
    c = Counters(HKV, torch.finfo(dtype).bits // 8, False, 4)
    per = prompt + steps + 1
    ctx = RunContext(SPEC, 4, B, turns * per, dtype, CPU, CPU, c, model)
    s = Full(Full.params(), ctx) if params is None else ArkVale(params, ctx)
    model.setup(s, c, turns * per)
    g = torch.Generator().manual_seed(6)
    rows = torch.randint(0, SPEC.vocab, (B, turns * (per if mode == "eval" else prompt)),
                         generator=g)
    out = decode_run(model, s, rows, steps, mode, lambda: None,
                     (lambda: bool(check(s))) if check else (lambda: None), turns)
    return s, c, out


def _layer(c: Counters, quantity: str, where: str, step: int) -> dict[int, float]:
    return {layer: v.get(step, 0.0) for q, w, layer, v in c.series()
            if q == quantity and w == where}


def _consistent(s: ArkVale) -> None:
    """Every pool slot names a distinct completed page and holds its host backup."""
    for layer, sp in s.slot_page.items():
        nf = s._split(s.length[layer])[0]
        for b in range(B):
            for h in range(HKV):
                pages = [int(p) for p in sp[b, h] if p >= 0]
                assert len(set(pages)) == len(pages) and all(p < nf for p in pages)
                for slot, p in enumerate(sp[b, h].tolist()):
                    if p >= 0:
                        assert torch.equal(s.pool_k[layer][b, h, slot], s.host_k[layer][p, b, h])
                        assert torch.equal(s.pool_v[layer][b, h, slot], s.host_v[layer][p, b, h])


def test_a_decode_step_files_its_pages_and_attention() -> None:
    """Prompt 32 in pages of 8: three full pages and a full current one, a pool of C = 3.
    The prefill backs up pages 0-2. Step 1 completes page 3 (backed up: B * Hkv pages to
    the host), which takes the slot of
    page 2 as it leaves the window (B * Hkv evictions), scores the digests of 4 pages, makes
    its top set resident (each recall two pages' worth of K and V over h2d, each into a
    full pool: one eviction more) and attends 3 pages and 1 token per KV head."""
    elem = 4
    s, c, _ = _run(ArkValeParams(budget_tokens=32, page_size=S, sinks=1, window_pages=2,
                                 dense_layers=1), prompt=32, steps=3, check=_consistent)
    assert s.c == 3
    step, sparse = 1, (1, 2, 3)
    # the prompt's three completed pages backed up, over d2h, at the prefill (step 0)
    assert _layer(c, "bytes_moved", "d2h", 0) == {
        layer: 2.0 * 3 * B * HKV * S * D * elem for layer in sparse}
    recalled = _layer(c, "pages", "recalled", step)
    evicted = _layer(c, "pages", "evicted", step)
    h2d, d2h = _layer(c, "bytes_moved", "h2d", step), _layer(c, "bytes_moved", "d2h", step)
    read, tokens = _layer(c, "bytes_read", "accel", step), _layer(c, "tokens", "accel", step)
    assert sum(recalled.get(layer, 0.0) for layer in sparse) > 0
    for layer in sparse:
        r = recalled.get(layer, 0.0)
        assert d2h[layer] == 2.0 * B * HKV * S * D * elem
        assert evicted[layer] == B * HKV + r
        assert h2d.get(layer, 0.0) == 2.0 * r * S * D * elem
        assert tokens[layer] == B * (3 * S + 1)
        assert read[layer] == s.dig[layer].nbytes(4 * S) + 2.0 * B * HKV * (3 * S + 1) * D * elem
    assert {w for q, w, _, _ in c.series() if q == "time"} == {"attention",
                                                               "bookkeeping.select"}
    n = 35
    dense = s.attended(0)
    assert dense.dtype == torch.bool and tuple(dense.shape) == (B, HQ, n) and bool(dense.all())
    for layer in sparse:
        mask = s.attended(layer)
        assert mask.dtype == torch.bool and tuple(mask.shape) == (B, HQ, n)
        assert bool((mask.sum(-1) == 3 * S + 3).all()) and bool(mask[:, :, 32:].all())


def test_while_the_pool_holds_every_page_everything_is_attended() -> None:
    """Prompt 32 (3 pages, the pool's C, and a full current one): no cut, no digest read;
    prompt 25 (3 pages and 1 token): decode steps while the pool holds exactly C pages
    select nothing, read no digest and attend every token."""
    params = ArkValeParams(budget_tokens=32, page_size=S, sinks=1, window_pages=2,
                           dense_layers=1)
    s, c, _ = _run(params, prompt=32, steps=0)
    assert s._split(32) == (3, 8)
    for layer in range(4):
        mask = s.attended(layer)
        assert mask.dtype == torch.bool and tuple(mask.shape) == (B, HQ, 32)
        assert bool(mask.all())
        assert _layer(c, "bytes_read", "accel", 0)[layer] == 2.0 * B * HKV * 32 * D * 4
    s, c, _ = _run(params, prompt=25, steps=2)
    assert s._split(26) == (3, 2)
    read = _layer(c, "bytes_read", "accel", 1)
    for layer in (1, 2, 3):
        assert read[layer] == 2.0 * B * HKV * 26 * D * 4  # 3 pages and 2 tokens, no digest
        assert bool(s.attended(layer).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_later_turn_reads_every_page_back_and_is_exact(dtype: torch.dtype) -> None:
    """Two turns of a 48-token prompt (eval, no decode steps): each prompt is attended
    densely over every page, those off the accelerator read back from the host ((nf - C)
    pages of K and V), so both predictions equal full attention's; the pool is then cut to
    the budget by the last query, every slot holding its page."""
    elem = torch.finfo(dtype).bits // 8
    prompt = 48
    params = ArkValeParams(budget_tokens=32, page_size=S, sinks=1, window_pages=2,
                           dense_layers=1)
    s, c, ours = _run(params, prompt, 0, mode="eval", turns=2, dtype=dtype)
    _consistent(s)
    *_, full = _run(None, prompt, 0, mode="eval", turns=2, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert len(ours.nll) == 2 * B
    assert ours.nll == pytest.approx(full.nll, rel=tol, abs=tol)
    nf = (prompt - 1) // S  # pages completed before the second turn's append: 5
    h2d = _layer(c, "bytes_moved", "h2d", 0)
    recalled = _layer(c, "pages", "recalled", 0)
    tokens, read = _layer(c, "tokens", "accel", 0), _layer(c, "bytes_read", "accel", 0)
    # the appends attend 48 keys, then 48 + 49 (the first turn's last token fed with the
    # second prompt); each cuts its pages (5, then 12 > C) after reading their digests
    for layer in (1, 2, 3):
        assert tokens[layer] == B * (48 + 97)
        assert read[layer] == 2.0 * B * HKV * (48 + 97) * D * elem \
            + s.dig[layer].nbytes(5 * S) + s.dig[layer].nbytes(12 * S)
    for layer in (1, 2, 3):
        assert h2d.get(layer, 0.0) == 2.0 * (nf - s.c) * B * HKV * S * D * elem \
            + 2.0 * recalled.get(layer, 0.0) * S * D * elem


def test_a_window_of_one_page_places_the_completed_page_from_the_accelerator() -> None:
    """With one window page a completed page enters the pool only when selected, copied on
    the accelerator; the pool stays consistent with the host backup at every step."""
    s, *_ = _run(ArkValeParams(budget_tokens=32, page_size=S, sinks=1, window_pages=1,
                               dense_layers=1), prompt=40, steps=20, check=_consistent)
    assert s._split(s.length[1])[0] > s.c


def test_enter_takes_the_slot_of_the_page_leaving_the_window() -> None:
    """Batch 3, 2 KV heads: page 5 completed with a window of 2 takes the slot holding page
    4 in each row (evicting it: the count it returns); with a window of 1 it enters no
    slot."""
    spec = ModelSpec("tiny-enter", "llama", 2, 4, 2, 16, 32, 50, 64, head_dim=4)
    for window, moved in ((2, True), (1, False)):
        c = Counters(2, 4, False, 2)
        ctx = RunContext(spec, 2, 3, 64, torch.float32, CPU, CPU, c, None)
        s = ArkVale(ArkValeParams(budget_tokens=16, page_size=4, sinks=1, window_pages=window,
                                  dense_layers=1), ctx)
        assert s.c == 3
        s.slot_page[1][:] = torch.tensor([[0, 4, 3], [4, 0, 3], [0, 3, 4]])[:, None, :]
        s.pool_k[1].copy_(torch.randn_like(s.pool_k[1]))  # allocated empty: may hold NaN
        before = s.pool_k[1].clone()
        cur = torch.randn(3, 2, 1, 4, 4)
        evicted = s._enter(1, 5, cur, cur + 1)
        got = s.slot_page[1]
        if not moved:
            assert torch.equal(got[:, 0], torch.tensor([[0, 4, 3], [4, 0, 3], [0, 3, 4]]))
            assert torch.equal(s.pool_k[1], before) and evicted == 0
            continue
        assert torch.equal(got[:, 0], torch.tensor([[0, 5, 3], [5, 0, 3], [0, 3, 5]]))
        for b, slot in enumerate((1, 0, 2)):
            assert torch.equal(s.pool_k[1][b, :, slot], cur[b, :, 0])
            assert torch.equal(s.pool_v[1][b, :, slot], cur[b, :, 0] + 1)
        assert evicted == 3 * 2


def test_split_of_an_empty_cache() -> None:
    spec = ModelSpec("tiny-split", "llama", 2, 4, 2, 16, 32, 50, 64, head_dim=4)
    ctx = RunContext(spec, 2, 1, 64, torch.float32, CPU, CPU, Counters(2, 4), None)
    s = ArkVale(ArkValeParams(budget_tokens=8, page_size=1, sinks=1, window_pages=1,
                              dense_layers=1), ctx)
    assert (s._split(0), s._split(1), s._split(2)) == ((0, 0), (0, 1), (1, 1))
