"""H2O: heavy hitters by accumulated attention plus a recent window; evicted KV is dropped.

Zhang et al., "H2O: Heavy-Hitter Oracle" (the baseline of HGCA sections 2.2 and 5.2): each
(batch, KV head) row keeps at most `budget` tokens on the accelerator (`--gpu-share` of the
KV, or `--gpu-tokens`): the `recent` share of them are the latest tokens, the rest the
tokens with the largest attention accumulated over all steps so far (column sums of the
prefill attention, then each decode step's softmax row, summed over the query heads of a
GQA group). After each decode step the row's lowest-scoring token outside the recent
window is evicted (per head, so rows keep different tokens); evicted tokens are gone for
good. The default budget, 20% of the KV (prompt + generated), is the HGCA paper's H2O
setting.

A prompt is admitted the same way whether it is the first (prefill, empty cache) or a
later turn's (append): causal attention over the kept tokens and the new ones, the new
queries' column sums added to the kept tokens' scores, then each row is cut back to the
budget: the latest `recent` share by position, the highest-scoring of the others.

Fidelity (docs/fidelity/h2o.md): FMInference/H2O ac75c2a's real-drop cache, GQA summed per
KV head (the authors' code has none), fp32 scores; authors (hh, r) = --gpu-tokens hh+r
--recent r/(hh+r).

Where the kept KV lives (`--kv-home`): `accel` (default: H2O's own code keeps it in GPU
memory) or `host`, as HGCA Fig. 12 runs H2O (section 5.1: InfiniGen's set-up, every KV entry
in CPU memory and loaded into GPU memory on demand; snu-comparch/InfiniGen
speedup/flexgen/h2o with `--percent 100 0 0 100 100 0 --overlap false`): each decode step
loads a layer's kept KV into one accelerator staging buffer (h2d, the whole buffer of
budget + 1 slots), attends there, and writes the new token back to the slot H2O freed in
host memory (d2h, one token a row). FlexGen indexes its CPU cache with the evicted index,
read on the host; here the token and its slots go to the host without blocking and are
written there before the layer's next load, after their copies' CUDA event: no sync inside
a step. Loads are not overlapped with compute (`--overlap false`). A prompt's kept set is
written back whole. Outputs, kept sets and scores are those of `accel`; scores and
positions stay on the accelerator (FlexGen moves its accumulated scores too: not counted).

Layout per layer: k/v [B, Hkv, budget + 1, D] with scores [B, Hkv, budget + 1] and token
positions, one free slot per row after each eviction. Positions are those the decoder
applied (no re-indexing inside the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbench.errors import require
from kvbench.strategies import (
    STRATEGIES,
    Strategy,
    _budget,
    column_scores,
    decode_weights,
    position_mask,
)
from kvbench.strategies._hostcopy import HostKV, to_host, transfer

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


@dataclass(frozen=True)
class H2OParams:
    """Accelerator KV budget (share of prompt + generated tokens, or tokens) and its
    recent-window share."""

    gpu_share: float = _budget.gpu_share(0.2)
    gpu_tokens: int = _budget.gpu_tokens()
    recent: float = field(default=0.5, metadata={
        "help": "Share of the budget reserved for the most recent tokens, in [0, 1)."})
    kv_home: str = field(default="accel", metadata={
        "help": "Where the kept KV lives: 'accel', or 'host' (loaded each decode step, as "
                "HGCA Fig. 12 runs H2O in FlexGen with InfiniGen's set-up)."})

    def __post_init__(self) -> None:
        _budget.check(self.gpu_share, self.gpu_tokens)
        require(0 <= self.recent < 1, f"--recent {self.recent}: must be in [0, 1)")
        require(self.kv_home in ("accel", "host"), f"--kv-home '{self.kv_home}': accel or "
                "host")


def group_sum(w: torch.Tensor, hkv: int) -> torch.Tensor:
    """Per-query-head weights [B, Hq, N] summed over each KV head's group: [B, Hkv, N]."""
    b, hq, n = w.shape
    return w.view(b, hkv, hq // hkv, n).sum(dim=2)


@STRATEGIES.register
class H2O(Strategy):
    """H2O: keep heavy hitters (accumulated attention) + recent tokens, drop the rest."""

    name = "h2o"
    version = "1"
    params = H2OParams
    exact = (("gpu_share", 1.0),)  # nothing evicted
    sparse = (("gpu_tokens", 32),)

    @classmethod
    def placement(cls, params: H2OParams, ctx: RunContext) -> dict[str, int]:
        """Per layer: k/v [B, Hkv, budget + 1, D], fp32 scores and int64 positions [B, Hkv,
        budget + 1] and the int64 slot each row freed [B, Hkv], all on the accelerator; with
        --kv-home host the k/v on the host (a DMA source, pinned on CUDA) and one layer's
        k/v staging on the accelerator."""
        s = ctx.spec
        n = _budget.kept(params.gpu_share, params.gpu_tokens, ctx.max_len) + 1
        rows = ctx.batch * s.n_kv_heads
        kv = rows * n * 2 * s.head_dim * ctx.elem_bytes  # one layer's k and v
        meta = ctx.n_layers * rows * (n * (4 + 8) + 8)
        if params.kv_home == "accel":
            return {"accel": ctx.n_layers * kv + meta, "host": 0}
        host = ctx.n_layers * kv
        return {"accel": kv + meta, "host": host,
                "pinned": host if ctx.accel.type == "cuda" else 0}

    def __init__(self, params: H2OParams, ctx: RunContext) -> None:
        import torch

        super().__init__(params, ctx)
        s = ctx.spec
        self.budget = _budget.kept(params.gpu_share, params.gpu_tokens, ctx.max_len)
        require(self.budget >= 1, f"--gpu-share {params.gpu_share} of {ctx.max_len} tokens "
                "keeps none")
        self.n_recent = int(self.budget * params.recent)
        shape = (ctx.batch, s.n_kv_heads, self.budget + 1)
        kv = (*shape, s.head_dim)
        # the kept k/v where they live; with --kv-home host, the accelerator's staging
        self.home = HostKV(ctx.accel.type == "cuda") if params.kv_home == "host" else None
        if self.home is None:
            self.k = [torch.empty(kv, dtype=ctx.dtype, device=ctx.accel)
                      for _ in range(ctx.n_layers)]
            self.v = [torch.empty_like(t) for t in self.k]
        else:
            self.k = [self.home.empty(kv, ctx.dtype) for _ in range(ctx.n_layers)]
            self.v = [self.home.empty(kv, ctx.dtype) for _ in range(ctx.n_layers)]
            self.stage = tuple(torch.empty(kv, dtype=ctx.dtype, device=ctx.accel)
                               for _ in range(2))
        self.inbox: list[Any] = [None] * ctx.n_layers  # a new token on its way to the host
        self.score = [torch.zeros(shape, dtype=torch.float32, device=ctx.accel)
                      for _ in range(ctx.n_layers)]
        self.pos = [torch.zeros(shape, dtype=torch.long, device=ctx.accel)
                    for _ in range(ctx.n_layers)]
        self.n = [0] * ctx.n_layers  # filled slots (same for every row)
        self.seen = [0] * ctx.n_layers  # tokens seen (next position)
        self.free: list[torch.Tensor | None] = [None] * ctx.n_layers  # [B, Hkv] slot

    def attended(self, layer: int) -> torch.Tensor | None:
        """The kept slots' positions (every slot was attended by the last decode)."""
        n = self.n[layer]
        return position_mask(self.pos[layer][:, :, :n], self.seen[layer],
                             self.ctx.spec.n_heads)

    def _cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's kept k/v [B, Hkv, budget + 1, D] where attention reads them: the cache,
        or (--kv-home host) the staging buffers, the host copy loaded into them whole."""
        if self.home is None:
            return self.k[layer], self.v[layer]
        if self.inbox[layer] is not None:
            self._land(layer)
        if self.n[layer]:
            for dst, src in zip(self.stage, (self.k[layer], self.v[layer]), strict=True):
                transfer(dst, src)
            self.ctx.counters.moved("h2d", 2 * self.k[layer].numel() * self.ctx.elem_bytes)
        return self.stage

    def _write_back(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                    slot: torch.Tensor | int) -> None:
        """--kv-home host: the new token's k/v [B, Hkv, 1, D] sent to the host for the host
        copy's `slot` (each row's freed slot [B, Hkv], or the next free one, the same for
        every row); written there at once off CUDA, before the layer's next load on CUDA."""
        sent = (k, v) if isinstance(slot, int) else (k, v, slot)
        got, landed = to_host(self.k[layer].device, *sent)
        self.inbox[layer] = (slot if isinstance(slot, int) else got[2], got[0], got[1],
                             landed)
        self.ctx.counters.moved("d2h", 2 * k.numel() * self.ctx.elem_bytes)
        if landed is None:
            self._land(layer)

    def _land(self, layer: int) -> None:
        """Write the token `_write_back` sent into the host copy (its CUDA copies waited
        for: a step ago, done)."""
        slot, k, v, landed = self.inbox[layer]
        self.inbox[layer] = None
        if landed is not None:
            landed.synchronize()
        hk, hv = self.k[layer], self.v[layer]
        if isinstance(slot, int):
            hk[:, :, slot:slot + 1], hv[:, :, slot:slot + 1] = k, v
        else:
            idx = slot[..., None, None].expand(-1, -1, 1, hk.shape[3])
            hk.scatter_(2, idx, k)
            hv.scatter_(2, idx, v)

    def _compact(self, layer: int, kc: torch.Tensor, vc: torch.Tensor) -> int:
        """Fill each row's free slot of kc/vc (the kept k/v) and the scores with its last
        slot: slots [0, n) are then all kept."""
        n, free = self.n[layer], self.free[layer]
        if free is not None:
            n -= 1
            slot = free[..., None]  # [B, Hkv, 1]
            for t in (kc, vc, self.score[layer], self.pos[layer]):
                idx = slot if t.dim() == 3 else slot[..., None].expand(-1, -1, 1, t.shape[3])
                t.scatter_(2, idx, t[:, :, n:n + 1].clone())
            self.n[layer], self.free[layer] = n, None
        return n

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Admit T new tokens (k/v [B, Hkv, T, D]) after the kept ones; out [B, Hq, T, D]."""
        import torch

        from kvbench.kernels.attention import dense_attention, note_backend

        kept_k, kept_v = self._cache(layer)
        n, t0, hkv = self._compact(layer, kept_k, kept_v), self.seen[layer], k.shape[1]
        kc = torch.cat([kept_k[:, :, :n], k], dim=2)  # [B, Hkv, n + T, D]
        vc = torch.cat([kept_v[:, :, :n], v], dim=2)
        out, lse = dense_attention(q, kc, vc)  # kept tokens precede the new: q_start = n
        self.ctx.counters.attended("accel", q, kc.shape[2])
        t1 = t0 + k.shape[2]
        new_pos = torch.arange(t0, t1, device=k.device).expand(*k.shape[:2], -1)
        pos = torch.cat([self.pos[layer][:, :, :n], new_pos], dim=2)
        with self.ctx.counters.timed("bookkeeping.scores"):
            score = group_sum(column_scores(q, kc, lse, q_start=n), hkv)  # [B, Hkv, n + T]
            score[:, :, :n] += self.score[layer][:, :, :n]
        if kc.shape[2] > self.budget:  # keep the recent tokens and the heaviest of the others
            rank = score.masked_fill(pos >= t1 - self.n_recent, float("inf"))
            keep = rank.topk(self.budget, dim=-1).indices.sort(dim=-1).values
            note_backend("torch-select", q)
            score, pos = score.gather(2, keep), pos.gather(2, keep)
            idx = keep[..., None].expand(-1, -1, -1, k.shape[3])
            kc, vc = kc.gather(2, idx), vc.gather(2, idx)
        n = kc.shape[2]
        kept_k[:, :, :n], kept_v[:, :, :n] = kc, vc
        self.score[layer][:, :, :n], self.pos[layer][:, :, :n] = score, pos
        self.n[layer], self.seen[layer] = n, t1
        if self.home is not None:  # the prompt's kept set written back whole
            transfer(self.k[layer], kept_k)
            transfer(self.v[layer], kept_v)
            self.ctx.counters.moved("d2h", 2 * kept_k.numel() * self.ctx.elem_bytes)
        return out

    prefill = append  # the first prompt: an append onto the empty cache

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        from kvbench.kernels.attention import dense_attention, note_backend

        kc, vc = self._cache(layer)
        score, pos = self.score[layer], self.pos[layer]
        t = self.seen[layer]
        free = self.free[layer]
        if free is None:  # room left: append at the end
            n = self.n[layer]
            kc[:, :, n], vc[:, :, n] = k[:, :, 0], v[:, :, 0]
            score[:, :, n], pos[:, :, n] = 0.0, t
            at: torch.Tensor | int = n
            self.n[layer] = n = n + 1
        else:  # the slot each row freed last step
            n, at = self.n[layer], free
            slot = free[..., None]
            idx = slot[..., None].expand(-1, -1, 1, k.shape[3])
            kc.scatter_(2, idx, k)
            vc.scatter_(2, idx, v)
            score.scatter_(2, slot, 0.0)
            pos.scatter_(2, slot, t)
        if self.home is not None:
            self._write_back(layer, k, v, at)
        self.seen[layer] = t + 1
        out, lse = dense_attention(q, kc[:, :, :n], vc[:, :, :n], causal=False)
        self.ctx.counters.attended("accel", q, n)
        with self.ctx.counters.timed("bookkeeping.scores"):
            score[:, :, :n] += group_sum(decode_weights(q, kc[:, :, :n], lse), k.shape[1])
            note_backend("torch-select", q)  # the eviction's scores, in torch ops
            if n == self.budget + 1:  # evict each row's lightest token outside the window
                old = pos[:, :, :n] < t + 1 - self.n_recent
                self.free[layer] = score[:, :, :n].masked_fill(~old, float("inf")).argmin(-1)
        return out
