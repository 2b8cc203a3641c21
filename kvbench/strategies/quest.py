"""Quest: query-aware page selection by min/max key digests, all KV on the accelerator.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference" (ICML
2024), Algorithm 1 and section 3.4 (spec sheet section 2): the KV cache is cut into pages
of S tokens (default 16, every script of the public code) with a channel-wise min/max
digest per page and KV head, updated as keys are written. At each decode step the query
scores every page by the upper bound sum_i max(q_i * max_i, q_i * min_i) and attention
runs over the top pages within `--budget-tokens` (default 2048, the paper's headline).
Prefill and multi-turn appends are dense (the authors' code attends densely whenever more
than one query arrives). The first `--dense-layers` (default 2, section 4.1) layers run
dense by their real index.

Variants (`--variant`):
- `authors` (default), the accuracy code behind the paper's perplexity and passkey figures
  (mit-han-lab/Quest `evaluation/quest_attention.py`): each query head (the KV heads
  repeated, `repeat_kv`) ranks every page, the current partial one like any other, and
  attends its top K = min(max(3, min(n, budget) // S), ceil(n / S)) pages over n cached
  tokens. The current token is attended only when its page is picked; the budget is capped
  at the context before rounding down, so a budget covering a context that is not a
  multiple of S still drops a page.
- `kernel`, the authors' kernel path (`quest/utils/controller.py`): K = budget // S pages,
  the current page always among them (`--window-pages`, default 1), plus `--sinks` first
  pages (default 0), top-k per query head or per KV group (`--topk-per`); dense while the
  context has at most K pages.

Fidelity (the full table: docs/fidelity/quest.md). Followed: mit-han-lab/Quest at commit
01c1623, `evaluation/quest_attention.py` (authors) and `quest/utils/controller.py`,
`quest/models/{llama,QuestAttention}.py`, `quest/ops/csrc/estimate.cu` (kernel).
Differences, and how each is selected:
- GQA: the accuracy code selects per query head (`repeat_kv`): `authors`; the kernel path
  has no GQA: `kernel --topk-per query|kv` (kv: kvbench's group sum). Selectable.
- current page forced in, sink pages, floor of 3 pages, budget capped at the context
  before rounding: per variant as above (`--sinks` is kvbench's). Selectable.
- dense layers: by real index, as the paper (sections 3.4, 4.1) and the kernel path; the
  accuracy code counts layer ids from 32 down (dense when 32 - L + i < 2: none of a
  30-layer model): `--dense-layers 0` on SmolLM2-135M. Selectable by option.
- a budget under one page: refused (the accuracy code gives it 3 pages, as `authors` does
  at `--budget-tokens S`). Not selectable: nothing lost.
- prefill and appends dense, digests from the keys as written, a new selection every step
  and sparse layer: as both paths. The same.
- dtype: the model dtype, scores in fp32 (the code: an fp16 model, fp32 scores; the kernel
  rounds scores to fp16). Not selectable beyond `--dtype`.
- passkey protocol: the authors decode the question token by token through Quest; kvbench's
  passkey mode prefills it with the prompt. Not selectable here (the runner's).

Exact setting: `authors` with pages of one token and a budget covering the context (every
token its own page, all kept). With S > 1, `authors` drops a page whenever S does not
divide n > 3S; `kernel` with a budget covering the context is exact at any S.
Layout per layer: k/v [B, Hkv, max_len, D] and digests lo/hi [B, Hkv, ceil(max_len/S), D]
on the accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbench.strategies import (
    STRATEGIES,
    Strategy,
    Variant,
    check_variant,
    position_mask,
    variant_field,
)
from kvbench.strategies._pages import (
    Digests,
    attend_selected,
    check_layers,
    check_pages,
    count_selected,
    kept_pages,
    select_positions,
)

if TYPE_CHECKING:
    import torch

    from kvbench.kernels.step import NativeCache, Pages
    from kvbench.runtime.context import RunContext

FLOOR = 3  # the accuracy code's fewest pages (`max(3, budget // S)`)


@dataclass(frozen=True)
class QuestParams:
    """Quest's semantics, page size, token budget and the layers it leaves dense."""

    variant: str = variant_field(
        Variant("authors", "mit-han-lab/Quest evaluation/quest_attention.py, the accuracy "
                "code: per query head the top max(3, min(context, budget) // S) pages, the "
                "current page ranked like any other", ignores=("sinks", "window_pages",
                                                               "topk_per")),
        Variant("kernel", "quest/utils/controller.py, the kernel path: budget // S pages, "
                "the current (partial) page always among them"))
    budget_tokens: int = field(default=2048, metadata={
        "help": "Tokens attended per decode step and layer, in whole pages (authors: "
                "capped at the context, then at least 3 pages; kernel: the current page "
                "included, a budget covering the context exact)."})
    page_size: int = field(default=16, metadata={"help": "Tokens per page (S)."})
    dense_layers: int = field(default=2, metadata={
        "help": "Leading layers that attend densely (by real layer index)."})
    sinks: int = field(default=0, metadata={"help": "kernel: first pages always attended."})
    window_pages: int = field(default=1, metadata={
        "help": "kernel: last pages always attended, the current (partial) page included."})
    topk_per: str = field(default="query", metadata={
        "help": "kernel: top-k per 'query' head (as the accuracy code) or per 'kv' head "
                "group (kvbench's; the kernel path has no GQA)."})

    def __post_init__(self) -> None:
        check_variant(self)
        check_pages(self.page_size, self.budget_tokens, self.sinks, self.window_pages,
                    self.dense_layers, self.topk_per)

    def pages(self, n: int) -> int:
        """Pages attended over n cached tokens (ceil(n / S) of them: dense)."""
        n_pages = -(-n // self.page_size)
        if self.variant == "authors":
            return min(max(FLOOR, min(n, self.budget_tokens) // self.page_size), n_pages)
        return kept_pages(self.budget_tokens, self.page_size, n)

    def rule(self) -> tuple[str, int, int]:
        """(top-k per 'query' or 'kv' head, sink pages, window pages) of the selection."""
        if self.variant == "authors":
            return "query", 0, 0
        return self.topk_per, self.sinks, self.window_pages


@STRATEGIES.register
class Quest(Strategy):
    """Quest: top pages by min/max key digests within a token budget, KV on the accelerator."""

    name = "quest"
    version = "2"
    params = QuestParams
    # every token its own page, all kept (module docstring: pages of S > 1 drop one)
    exact = (("budget_tokens", 1 << 20), ("page_size", 1))
    sparse = (("budget_tokens", 32),)

    @classmethod
    def placement(cls, params: QuestParams, ctx: RunContext) -> dict[str, int]:
        """Every layer's k/v [B, Hkv, max_len, D] and digests lo/hi [B, Hkv, P_max, D] (1/S
        of the K+V bytes) on the accelerator; per sparse layer, the last step's selection:
        positions [B, H, K * S] and lengths [B, H] (H: query or KV heads, K: the budget's
        pages, fewer than the cache's), int32 from the native selection (CPU float32),
        int64 from torch's."""
        import torch

        from kvbench.kernels import cpu

        s, page = ctx.spec, params.page_size
        kv = ctx.batch * ctx.max_len * s.kv_bytes_per_token(ctx.elem_bytes, ctx.n_layers)
        heads = ctx.batch * (s.n_heads if params.rule()[0] == "query" else s.n_kv_heads)
        k_pages = min(params.pages(1 << 62), -(-ctx.max_len // page) - 1)  # any context
        sparse = ctx.n_layers - min(params.dense_layers, ctx.n_layers)
        digests = (ctx.n_layers * 2 * ctx.batch * s.n_kv_heads * -(-ctx.max_len // page)
                   * s.head_dim * ctx.elem_bytes)
        native = ctx.accel.type == "cpu" and ctx.dtype == torch.float32 and cpu.native_built()
        return {"accel": kv + digests + sparse * heads * (k_pages * page + 1) * (4 if native
                                                                                 else 8),
                "host": 0}

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
        # sparse layer -> the buffers a native step selects into (`native_cache`, made on
        # its first use): positions [B, H, K_max * S], lengths [B, H] int32
        self._sel: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

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
        # narrow: one op each (indexing dispatched a slice and an alias per view here)
        self.k[layer].narrow(2, n0, n1 - n0).copy_(k)
        self.v[layer].narrow(2, n0, n1 - n0).copy_(v)
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
        kc, vc = self.k[layer].narrow(2, 0, n), self.v[layer].narrow(2, 0, n)
        n_pages, k_pages = -(-n // p.page_size), p.pages(n)
        counters = self.ctx.counters
        if layer < p.dense_layers or k_pages >= n_pages:
            self.last[layer] = None
            out, _ = dense_attention(q, kc, vc, causal=False)
            counters.attended("accel", q, n)
            return out
        dig = self.dig[layer]
        per, sinks, window = p.rule()
        lo, hi = dig.lo.narrow(2, 0, n_pages), dig.hi.narrow(2, 0, n_pages)
        with counters.timed("bookkeeping.select"):
            pos, lens = select_positions(q, lo, hi, n_pages, k_pages, sinks, window, per,
                                         p.page_size, n)
        counters.add("bytes_read", "accel", dig.nbytes(n))
        self.last[layer] = pos, lens
        return attend_selected(q, kc, vc, pos, lens, counters)[0]

    def native_cache(self, layer: int) -> NativeCache:
        """The layer's cache, digests and, on a sparse layer, its selection buffers."""
        import torch

        from kvbench.kernels.step import NativeCache

        p, dig = self.p, self.dig[layer]
        if layer < p.dense_layers:
            return NativeCache(self.k[layer], self.v[layer], self.length[layer], dig.lo, dig.hi)
        if layer not in self._sel:
            b, hkv = self.k[layer].shape[:2]
            h = self.ctx.spec.n_heads if p.rule()[0] == "query" else hkv
            self._sel[layer] = (torch.zeros(b, h, p.pages(1 << 62) * p.page_size,
                                            dtype=torch.int32),
                                torch.zeros(b, h, dtype=torch.int32))
        return NativeCache(self.k[layer], self.v[layer], self.length[layer], dig.lo, dig.hi,
                           *self._sel[layer])

    def native_rule(self, n: int) -> Pages:
        """This step's rule (`QuestParams.rule`) and pages kept over n tokens."""
        from kvbench.kernels.step import Pages

        per, sinks, window = self.p.rule()
        return Pages(self.p.page_size, self.p.pages(n), sinks, window, per != "query")

    def decoded(self, layer: int, q: torch.Tensor, select_s: float) -> None:
        """The token is cached, digested and attended (densely, or over the pages the step
        selected into the layer's buffers): count it as `decode` does."""
        p, counters = self.p, self.ctx.counters
        if select_s >= 0:
            counters.elapsed("bookkeeping.select", select_s)
        n = self.length[layer] = self.length[layer] + 1
        k_pages = p.pages(n)
        if layer < p.dense_layers or k_pages >= -(-n // p.page_size):
            self.last[layer] = None
            counters.attended("accel", q, n)
            return
        counters.add("bytes_read", "accel", self.dig[layer].nbytes(n))
        self.last[layer] = self._sel[layer]  # rows wider than the selection: lens says
        count_selected(q, self._sel[layer][1], counters)
