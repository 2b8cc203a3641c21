"""Quest: query-aware page selection by min/max key digests, all KV on the accelerator.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference" (ICML
2024), Algorithm 1 and section 3.4 (spec sheet section 2): the KV cache is cut into pages
of S tokens (default 16, every script of the public code) with a channel-wise min/max
digest per page and KV head, updated as keys are written. At each decode step the query
scores every page by the upper bound sum_i max(q_i * max_i, q_i * min_i) and attention
runs over the top pages within `--budget-tokens` (default 2048, the paper's headline,
capped by the context). Prefill and multi-turn appends are dense (Quest prefills dense;
its LongBench runs feed the question token by token after a dense context).

Choices, recorded in the params: pages are picked per query head by default (`topk_per
= query`, the accuracy code's `repeat_kv`; `kv` shares one set per GQA group); the current
(last, partial) page is always attended and counts against the budget (the kernel path,
`controller.py`), `--sinks` first pages likewise (default 0); the first `--dense-layers`
(default 2) layers run dense by their real index (the public eval code counts layer ids
from 32 down, so on a 30-layer model it skips none).

Exact setting: a budget covering the context (every page selected, dense attention).
Layout per layer: k/v [B, Hkv, max_len, D] and digests lo/hi [B, Hkv, ceil(max_len/S), D]
on the accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbench.strategies import STRATEGIES, Strategy, position_mask
from kvbench.strategies._pages import (
    Digests,
    attend_selected,
    check_layers,
    check_pages,
    page_scores,
    page_tokens,
    select_pages,
)

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


@dataclass(frozen=True)
class QuestParams:
    """Quest's page size, token budget and the layers it leaves dense."""

    budget_tokens: int = field(default=2048, metadata={
        "help": "Tokens attended per decode step and layer (whole pages, the current page "
                "included); a budget covering the context is exact."})
    page_size: int = field(default=16, metadata={"help": "Tokens per page (S)."})
    dense_layers: int = field(default=2, metadata={
        "help": "Leading layers that attend densely (by real layer index)."})
    sinks: int = field(default=0, metadata={"help": "First pages always attended."})
    window_pages: int = field(default=1, metadata={
        "help": "Last pages always attended, the current (partial) page included."})
    topk_per: str = field(default="query", metadata={
        "help": "Top-k per 'query' head (Quest's accuracy code) or per 'kv' head group."})

    def __post_init__(self) -> None:
        check_pages(self.page_size, self.budget_tokens, self.sinks, self.window_pages,
                    self.dense_layers, self.topk_per)


@STRATEGIES.register
class Quest(Strategy):
    """Quest: top pages by min/max key digests within a token budget, KV on the accelerator."""

    name = "quest"
    version = "1"
    params = QuestParams
    exact = (("budget_tokens", 1 << 20),)  # every page selected

    @classmethod
    def placement(cls, params: QuestParams, ctx: RunContext) -> dict[str, int]:
        """Every layer's k/v [B, Hkv, max_len, D] and digests lo/hi [B, Hkv, P_max, D] (1/S
        of the K+V bytes) on the accelerator; per sparse layer, the last step's selection:
        int64 positions [B, H, K * S] and lengths [B, H] (H: query or KV heads, K: the
        budget's pages, fewer than the cache's)."""
        s, page = ctx.spec, params.page_size
        kv = ctx.batch * ctx.max_len * s.kv_bytes_per_token(ctx.elem_bytes, ctx.n_layers)
        heads = ctx.batch * (s.n_heads if params.topk_per == "query" else s.n_kv_heads)
        k_pages = min(params.budget_tokens // page, -(-ctx.max_len // page) - 1)
        sparse = ctx.n_layers - min(params.dense_layers, ctx.n_layers)
        digests = (ctx.n_layers * 2 * ctx.batch * s.n_kv_heads * -(-ctx.max_len // page)
                   * s.head_dim * ctx.elem_bytes)
        return {"accel": kv + digests + sparse * heads * (k_pages * page + 1) * 8, "host": 0}

    def __init__(self, params: QuestParams, ctx: RunContext) -> None:
        import torch

        super().__init__(params, ctx)
        check_layers(params.dense_layers, ctx.n_layers)
        s = ctx.spec
        shape = (ctx.batch, s.n_kv_heads, ctx.max_len, s.head_dim)
        self.k = [torch.empty(shape, dtype=ctx.dtype, device=ctx.accel)
                  for _ in range(ctx.n_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.dig = [Digests(ctx.batch, s.n_kv_heads, ctx.max_len, s.head_dim,
                            params.page_size, "minmax", ctx.accel, ctx.dtype)
                    for _ in range(ctx.n_layers)]
        self.length = [0] * ctx.n_layers
        # layer -> (positions [B, H, K*S], lengths [B, H]) of its last sparse decode
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def attended(self, layer: int) -> torch.Tensor | None:
        import torch

        n, hq = self.length[layer], self.ctx.spec.n_heads
        sel = self.last.get(layer)
        if sel is None:  # dense
            return torch.ones(self.ctx.batch, hq, n, dtype=torch.bool, device=self.ctx.accel)
        return position_mask(sel[0], n, hq, sel[1])

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        n0 = self.length[layer]
        n1 = n0 + k.shape[2]
        self.k[layer][:, :, n0:n1], self.v[layer][:, :, n0:n1] = k, v
        self.dig[layer].update(self.k[layer], n0, n1)
        self.length[layer] = n1
        return n1

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Dense causal attention of T new tokens over the cache and themselves."""
        from kvbench.kernels.attention import dense_attention

        n = self._write(layer, k, v)
        out, _ = dense_attention(q, self.k[layer][:, :, :n], self.v[layer][:, :, :n])
        self.ctx.counters.attended("accel", q, n)
        return out

    prefill = append  # the first prompt: dense, onto the empty cache

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """One token: score pages with its query, attend the top ones (module docstring)."""
        from kvbench.kernels.attention import dense_attention

        p = self.p
        n = self._write(layer, k, v)
        kc, vc = self.k[layer][:, :, :n], self.v[layer][:, :, :n]
        n_pages, k_pages = -(-n // p.page_size), p.budget_tokens // p.page_size
        counters = self.ctx.counters
        if layer < p.dense_layers or k_pages >= n_pages:
            self.last[layer] = None
            out, _ = dense_attention(q, kc, vc, causal=False)
            counters.attended("accel", q, n)
            return out
        dig = self.dig[layer]
        with counters.timed("bookkeeping.select"):
            scores = page_scores(q, dig.lo[:, :, :n_pages], dig.hi[:, :, :n_pages],
                                 p.topk_per)
            pages = select_pages(scores, n_pages, k_pages, p.sinks, p.window_pages)
            pos, lens = page_tokens(pages, p.page_size, n)
        counters.add("bytes_read", "accel", dig.nbytes(n))
        self.last[layer] = pos, lens
        return attend_selected(q, kc, vc, pos, lens, counters)[0]
