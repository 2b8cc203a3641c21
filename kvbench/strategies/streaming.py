"""StreamingLLM: attention sinks (the first tokens) plus a window of the most recent ones.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (a baseline in the
HGCA comparison, section 2.2's static sparse attention): each layer keeps the first
`sinks` tokens and the latest `budget - sinks` tokens on the accelerator (`budget`:
`--gpu-share` of the KV rounded up, or `--gpu-tokens`); a token leaving
the window is dropped. Positions are those the decoder applied (the cache is not
re-indexed, unlike the paper's rolling positions), which matches how HGCA Table 1 style
evaluations apply static patterns to a model's original positions.

A prompt, the first (prefill) or a later turn's (append), attends densely and causally
to the cache and to itself; then only the sinks and the latest window stay.

Fidelity (docs/fidelity/streaming.md): mit-han-lab/streaming-llm 2e50426 without its position
shift; the budget counts the new token: authors (start s, recent r) = --sinks s
--gpu-tokens s+r+1.

Layout per layer: k/v [B, Hkv, budget, D]; slots [0, sinks) hold the sinks, the rest a ring
where the token at position t lives in slot sinks + (t - sinks) mod (budget - sinks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbench.errors import require
from kvbench.strategies import STRATEGIES, Strategy, _budget

if TYPE_CHECKING:
    import torch

    from kvbench.kernels.step import NativeCache
    from kvbench.runtime.context import RunContext


@dataclass(frozen=True)
class StreamingParams:
    """Accelerator KV budget (share of prompt + generated tokens, or tokens) and the number
    of sink tokens."""

    gpu_share: float = _budget.gpu_share(0.2, "; rounded up")
    gpu_tokens: int = _budget.gpu_tokens()
    sinks: int = field(default=4, metadata={"help": "Initial tokens always kept (>= 0)."})

    def __post_init__(self) -> None:
        _budget.check(self.gpu_share, self.gpu_tokens)
        require(self.sinks >= 0, f"--sinks {self.sinks}: must be >= 0")


@STRATEGIES.register
class Streaming(Strategy):
    """StreamingLLM: attention sinks + a recent window on the accelerator, the rest dropped."""

    name = "streaming"
    version = "1"
    params = StreamingParams
    exact = (("gpu_share", 1.0),)  # the window holds every token
    sparse = (("gpu_tokens", 32),)

    @classmethod
    def placement(cls, params: StreamingParams, ctx: RunContext) -> dict[str, int]:
        """Per layer: k/v [B, Hkv, budget, D] on the accelerator."""
        n = _budget.kept(params.gpu_share, params.gpu_tokens, ctx.max_len, round_up=True)
        return {"accel": n * ctx.batch * ctx.spec.kv_bytes_per_token(ctx.elem_bytes,
                                                                     ctx.n_layers), "host": 0}

    def __init__(self, params: StreamingParams, ctx: RunContext) -> None:
        import torch

        super().__init__(params, ctx)
        s = ctx.spec
        self.budget = _budget.kept(params.gpu_share, params.gpu_tokens, ctx.max_len,
                                   round_up=True)
        self.ring = self.budget - params.sinks
        require(self.ring >= 1, f"a budget of {self.budget} of {ctx.max_len} tokens leaves "
                f"no recent window after {params.sinks} sinks")
        shape = (ctx.batch, s.n_kv_heads, self.budget, s.head_dim)
        self.k = [torch.empty(shape, dtype=ctx.dtype, device=ctx.accel)
                  for _ in range(ctx.n_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.seen = [0] * ctx.n_layers

    def attended(self, layer: int) -> torch.Tensor | None:
        """The sinks and the latest `ring` positions (all while the budget holds them)."""
        import torch

        n = self.seen[layer]
        mask = torch.ones(self.ctx.batch, self.ctx.spec.n_heads, n, dtype=torch.bool,
                          device=self.ctx.accel)
        if n > self.budget:
            mask[:, :, self.p.sinks:n - self.ring] = False
        return mask

    def _slot(self, t: int) -> int:
        """Slot of the token at position t (t < budget: slot t)."""
        s = self.p.sinks
        return t if t < s else s + (t - s) % self.ring

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Admit T new tokens (k/v [B, Hkv, T, D]) after the cached ones; out [B, Hq, T, D]."""
        import torch

        from kvbench.kernels.attention import dense_attention

        t0 = self.seen[layer]
        t1, n = t0 + k.shape[2], min(t0, self.budget)  # n cached tokens fill slots [0, n)
        kc = torch.cat([self.k[layer][:, :, :n], k], dim=2)  # [B, Hkv, n + T, D]
        vc = torch.cat([self.v[layer][:, :, :n], v], dim=2)
        out, _ = dense_attention(q, kc, vc)  # the cache precedes the new tokens: q_start = n
        self.ctx.counters.attended("accel", q, kc.shape[2])
        keep = [t for t in range(t0, t1) if t < self.p.sinks or t >= t1 - self.ring]
        slots = torch.tensor([self._slot(t) for t in keep], device=k.device)
        src = torch.tensor(keep, device=k.device) - t0
        self.k[layer][:, :, slots] = k[:, :, src]
        self.v[layer][:, :, slots] = v[:, :, src]
        self.seen[layer] = t1
        return out

    prefill = append  # the first prompt: an append onto the empty cache

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        from kvbench.kernels.attention import dense_attention

        t = self.seen[layer]
        slot = self._slot(t)
        self.k[layer][:, :, slot], self.v[layer][:, :, slot] = k[:, :, 0], v[:, :, 0]
        self.seen[layer] = t + 1
        n = min(t + 1, self.budget)
        out, _ = dense_attention(q, self.k[layer][:, :, :n], self.v[layer][:, :, :n],
                                 causal=False)
        self.ctx.counters.attended("accel", q, n)
        return out

    def native_cache(self, layer: int) -> NativeCache:
        """The layer's slots, the new token's slot and the slots filled with it."""
        from kvbench.kernels.step import NativeCache

        t = self.seen[layer]
        return NativeCache(self.k[layer], self.v[layer], t, slot=self._slot(t),
                           span=min(t + 1, self.budget))

    def decoded(self, layer: int, q: torch.Tensor, select_s: float) -> None:
        """The token is in its slot and the filled slots attended: as `decode`."""
        self.seen[layer] += 1
        self.ctx.counters.attended("accel", q, min(self.seen[layer], self.budget))
