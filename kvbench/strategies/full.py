"""Full attention with the whole KV cache resident on the accelerator: the reference.

Every other strategy is judged against this one: no KV leaves the accelerator, attention
is dense over all cached tokens (HGCA Table 1 "full attention" reference; FlexGen's
baseline when the cache fits). Prefill, decode and append are one path: write the new
k/v after the cached ones, then causal attention of the new queries over the whole cache.
Fidelity (to the model; no variants): docs/fidelity/full.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvbench.strategies import STRATEGIES, Strategy

if TYPE_CHECKING:
    import torch

    from kvbench.kernels.step import NativeCache
    from kvbench.runtime.context import RunContext


@STRATEGIES.register
class Full(Strategy):
    """All KV on the accelerator, dense attention over every token (the reference)."""

    name = "full"
    version = "1"
    exact = ()  # the reference itself

    def __init__(self, params: object, ctx: RunContext) -> None:
        import torch

        super().__init__(params, ctx)
        s = ctx.spec
        shape = (ctx.batch, s.n_kv_heads, ctx.max_len, s.head_dim)
        # per layer: k and v buffers [B, Hkv, max_len, D] on the accelerator
        self.k = [torch.empty(shape, dtype=ctx.dtype, device=ctx.accel)
                  for _ in range(ctx.n_layers)]
        self.v = [torch.empty(shape, dtype=ctx.dtype, device=ctx.accel)
                  for _ in range(ctx.n_layers)]
        self.length = [0] * ctx.n_layers

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Cache k/v [B, Hkv, T, D]; attention [B, Hq, T, D] of q at the last T positions."""
        import torch

        from kvbench.kernels.attention import dense_attention

        n0, n1 = self.length[layer], self.length[layer] + k.shape[2]
        self.k[layer][:, :, n0:n1] = k
        self.v[layer][:, :, n0:n1] = v
        self.length[layer] = n1
        # the run's --threads bounds the native CPU kernel like every torch op
        out, _ = dense_attention(q, self.k[layer][:, :, :n1], self.v[layer][:, :, :n1],
                                 threads=torch.get_num_threads())
        self.ctx.counters.attended("accel", q, n1)
        return out

    decode = append = prefill  # one path for any number of new tokens

    def native_cache(self, layer: int) -> NativeCache:
        """The layer's buffers [B, Hkv, max_len, D] and the tokens they hold."""
        from kvbench.kernels.step import NativeCache

        return NativeCache(self.k[layer], self.v[layer], self.length[layer])

    def decoded(self, layer: int, q: torch.Tensor, select_s: float) -> None:
        """A native step's token is cached and attended: as `decode` after its kernel."""
        self.length[layer] += 1
        self.ctx.counters.attended("accel", q, self.length[layer])

    def export_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of the cached k/v [B, Hkv, n, D] per layer."""
        return [(k[:, :, :n], v[:, :, :n]) for k, v, n in zip(self.k, self.v, self.length,
                                                                strict=True)]

    def import_kv(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy k/v [B, Hkv, n, D] per layer into the (empty) buffers."""
        for layer, (k, v) in enumerate(kv):
            n = k.shape[2]
            self.k[layer][:, :, :n] = k
            self.v[layer][:, :, :n] = v
            self.length[layer] = n
