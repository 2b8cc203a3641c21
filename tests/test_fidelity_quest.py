"""kvbench's quest against independent float64 transcriptions of the authors' two rules
(mit-han-lab/Quest at 01c1623; docs/fidelity/quest.md):

- `authors` = evaluation/quest_attention.py (the paper's perplexity and passkey code): the KV
  heads repeated to every query head, each query head bounds every page (the current,
  partial one too) by sum_i |q_i| * max over the page of sign(q_i) * k_i, and keeps its
  top max(3, min(n, budget) // S) pages, at most all of them;
- `kernel` = quest/utils/controller.py: budget // S pages, the last page always one of
  them, the rest the top of the earlier pages; every page while the context has no more.

Selected sets must be identical over several decode steps (GQA, 6 query heads over 2 KV
heads, crossing a page boundary), outputs equal to fp32 tolerance, the budget edge cases
included; bad variant input is one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error, cli

from kvbench.models import ModelSpec
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies.quest import Quest, QuestParams

SPEC = ModelSpec("tiny-gqa", "llama", 2, 6, 2, 48, 96, 100, 512, head_dim=8)
B, HQ, HKV, D = 2, 6, 2, 8
G = HQ // HKV


def _ctx(max_len: int, device: torch.device = torch.device("cpu")) -> RunContext:
    return RunContext(SPEC, 2, B, max_len, torch.float32, device, torch.device("cpu"),
                      Counters(HKV, 4, cuda=device.type == "cuda"))


def _bound(q: torch.Tensor, keys: torch.Tensor) -> float:
    """The upper bound of q . k over a page's keys [m, D], written as the accuracy code
    forms it: |q| against the page's maximum of the sign-flipped keys (sign -1 at q = 0)."""
    flip = torch.where(q > 0, 1.0, -1.0).double()
    return float((q.double().abs() * (keys.double() * flip).amax(0)).sum())


def _page_keys(keys: torch.Tensor, p: int, page: int) -> torch.Tensor:
    return keys[p * page:min(keys.shape[0], (p + 1) * page)]


def authors_pages(q: torch.Tensor, keys: torch.Tensor, budget: int, page: int) -> list[int]:
    """One query head's pages under the accuracy code: q [D], its KV head's keys [n, D]."""
    n = keys.shape[0]
    n_pages = -(-n // page)
    want = min(max(3, min(n, budget) // page), n_pages)
    score = {p: _bound(q, _page_keys(keys, p, page)) for p in range(n_pages)}
    return sorted(sorted(score, key=lambda p: -score[p])[:want])


def kernel_pages(qs: list[torch.Tensor], keys: torch.Tensor, budget: int, page: int
                 ) -> list[int]:
    """One row's pages under controller.py (one query head: qs = [q]; kvbench's per-group
    generalisation: the group's query heads, their bounds summed)."""
    n_pages = -(-keys.shape[0] // page)
    k = budget // page
    if n_pages <= k:
        return list(range(n_pages))
    last = n_pages - 1
    score = {p: sum(_bound(q, _page_keys(keys, p, page)) for q in qs) for p in range(last)}
    return sorted([*sorted(score, key=lambda p: -score[p])[:k - 1], last])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, toks: list[int]
            ) -> torch.Tensor:
    w = torch.softmax(k[toks].double() @ q.double() * D ** -0.5, dim=0)
    return (w[:, None] * v[toks].double()).sum(0)


def _run(params: QuestParams, n0: int, steps: int, seed: int, rule,
         device: torch.device = torch.device("cpu")) -> list[list[int]]:
    """Prefill n0 tokens into layer 1 (sparse; layer 0 dense), decode `steps` tokens; at
    each step hold kvbench's attended set and output per (sequence, query head) against
    `rule(b, h, q, keys)` -> page ids. Returns the reference's page lists, step-major.
    kvbench runs on `device`, the reference on the CPU."""
    g = torch.Generator().manual_seed(seed)
    s = Quest(params, _ctx(n0 + steps, device))
    k, v = torch.randn(B, HKV, n0, D, generator=g), torch.randn(B, HKV, n0, D, generator=g)
    s.prefill(1, torch.randn(B, HQ, n0, D, generator=g).to(device), k.to(device), v.to(device))
    seen = []
    for _ in range(steps):
        q = torch.randn(B, HQ, 1, D, generator=g)
        kn, vn = torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g)
        out = s.decode(1, q.to(device), kn.to(device), vn.to(device)).cpu()
        k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
        n, mask = k.shape[2], s.attended(1).cpu()
        for b in range(B):
            for h in range(HQ):
                pages = rule(b, h, q, k[b, h // G])
                toks = [t for p in pages for t in range(p * params.page_size,
                                                        min(n, (p + 1) * params.page_size))]
                assert mask[b, h].nonzero().flatten().tolist() == toks, (n, b, h, pages)
                want = _attend(q[b, h, 0], k[b, h // G], v[b, h // G], toks)
                assert torch.allclose(out[b, h, 0].double(), want, atol=1e-5), (n, b, h)
                seen.append(pages)
    return seen


def test_authors_variant_is_the_accuracy_codes_selection(device: torch.device) -> None:
    """Budget 32 in pages of 8 (4 of up to 7 pages), 45 prompt tokens then 8 decode steps
    (crossing 48): per query head, the current page ranked like the others."""
    budget, page = 32, 8
    params = QuestParams(budget_tokens=budget, page_size=page, dense_layers=1)
    assert params.variant == "authors"
    seen = _run(params, 45, 8, 0, lambda b, h, q, keys: authors_pages(
        q[b, h, 0], keys, budget, page), device)
    cur = [(45 + i // (B * HQ)) // page in p for i, p in enumerate(seen)]
    assert not all(cur) and any(cur)  # the current page is sometimes left out, sometimes not
    groups = [seen[i:i + G] for i in range(0, len(seen), G)]
    assert any(len({tuple(p) for p in grp}) > 1 for grp in groups)  # per query head, not shared


@pytest.mark.parametrize("budget, n0, steps", [
    (8, 37, 4),      # one page: the 3-page floor
    (16, 37, 4),     # two pages: the floor
    (1024, 45, 6),   # covering the context: a page dropped unless n % 8 == 0 (n = 48: all)
    (50, 45, 6),     # capped at the context: 5 of 6 pages at n = 46, all at 48, then 6 of 7
])
def test_authors_budget_edges(budget: int, n0: int, steps: int) -> None:
    page = 8
    params = QuestParams(budget_tokens=budget, page_size=page, dense_layers=1)
    seen = _run(params, n0, steps, budget, lambda b, h, q, keys: authors_pages(
        q[b, h, 0], keys, budget, page))
    per_step = [seen[i:i + B * HQ] for i in range(0, len(seen), B * HQ)]
    for i, rows in enumerate(per_step):
        n = n0 + i + 1
        n_pages = -(-n // page)
        assert {len(p) for p in rows} == {min(max(3, min(n, budget) // page), n_pages)}


@pytest.mark.parametrize("per", ["query", "kv"])
@pytest.mark.parametrize("budget", [16, 32, 56])
def test_kernel_variant_is_the_controllers_selection(per: str, budget: int,
                                                    device: torch.device) -> None:
    """The current page always attended and counted; 56 = 7 pages: every page until the
    context passes 56 tokens."""
    page = 8
    params = QuestParams(variant="kernel", budget_tokens=budget, page_size=page,
                         dense_layers=1, topk_per=per)

    def rule(b: int, h: int, q: torch.Tensor, keys: torch.Tensor) -> list[int]:
        heads = [h] if per == "query" else range(h // G * G, h // G * G + G)
        return kernel_pages([q[b, x, 0] for x in heads], keys, budget, page)

    seen = _run(params, 45, 14, budget, rule, device)
    assert all(p[-1] == -(-(45 + i // (B * HQ) + 1) // page) - 1 for i, p in enumerate(seen))


def test_dense_layers_attend_every_token() -> None:
    g = torch.Generator().manual_seed(9)
    s = Quest(QuestParams(budget_tokens=8, page_size=8, dense_layers=1), _ctx(60))
    k = torch.randn(B, HKV, 50, D, generator=g)
    s.prefill(0, torch.randn(B, HQ, 50, D, generator=g), k, k.clone())
    s.decode(0, torch.randn(B, HQ, 1, D, generator=g), k[:, :, :1], k[:, :, :1])
    assert s.attended(0).all()


@pytest.mark.parametrize("variant", ["authors", "kernel"])
def test_a_steps_work_dense_at_a_covering_budget_and_sparse_below(variant: str) -> None:
    """What one step files, counted in the test: at a budget of every page (48 tokens in 6
    pages of 8; authors' rounding keeps 6 of 6 only for a context of whole pages) the dense
    path: every token attended on the accelerator, its K and V read, no selection timed, no
    digest read; at 2 pages the selection timed as bookkeeping and the pages' digests read
    beside the KV of the selected tokens."""
    elem = 4
    for budget, dense in ((48, True), (16, False)):
        g = torch.Generator().manual_seed(5)
        extra = {"sinks": 1} if variant == "kernel" else {}
        s = Quest(QuestParams(variant=variant, budget_tokens=budget, page_size=8,
                              dense_layers=1, **extra), _ctx(48))
        c = s.ctx.counters
        k = torch.randn(B, HKV, 47, D, generator=g)
        s.prefill(1, torch.randn(B, HQ, 47, D, generator=g), k, k.clone())
        c.step = 1
        kn = torch.randn(B, HKV, 1, D, generator=g)
        s.decode(1, torch.randn(B, HQ, 1, D, generator=g), kn, kn.clone())
        read, select = c.step_total("bytes_read", "accel", 1), c.step_total("time",
                                                                            "bookkeeping.select", 1)
        if dense:
            assert s.last[1] is None and select == 0.0
            assert c.step_total("tokens", "accel", 1) == B * 48
            assert read == 2 * B * HKV * 48 * D * elem
            continue
        lens = s.last[1][1]
        assert select > 0.0 and int(lens.max()) == (24 if variant == "authors" else 16)  # 3+
        digests = 2 * B * HKV * 6 * D * elem  # lo and hi of 6 pages per (sequence, KV head)
        # each selection row (a KV head's, or a query head's under authors) reads its K and V
        assert read == pytest.approx(float(lens.sum()) * 2 * D * elem + digests)
        if variant == "kernel":  # the sink page is always kept
            assert bool((s.attended(1)[:, :, :8]).all())


TINY = ["--model", "smollm2-135m", "--weights", "random", "--layers", "3", "--prompt-len",
        "40", "--gen-len", "2"]


@pytest.mark.parametrize("args, message", [
    (["--variant", "nope"], "--variant 'nope': unknown (variants: authors, kernel)"),
    (["--variant", "authors", "--window-pages", "2"],
     "--window-pages is not a parameter of variant 'authors' (variants: authors, kernel)"),
    (["--sinks", "1"], "--sinks is not a parameter of variant 'authors' (variants: authors, "
                       "kernel)"),
    (["--topk-per", "kv"], "--topk-per is not a parameter of variant 'authors'"),
])
def test_bad_variant_input_exits_2(args: list[str], message: str, capsys,
                                   tmp_path: Path) -> None:
    out = tmp_path / "x.jsonl"
    assert_usage_error(cli(["run", "quest", *args, *TINY, "--out", str(out)], capsys), message)
    assert not out.exists()


def test_kernel_takes_what_authors_does_not() -> None:
    p = QuestParams(variant="kernel", sinks=1, window_pages=2, topk_per="kv")
    assert (p.sinks, p.window_pages, p.topk_per) == (1, 2, "kv")
