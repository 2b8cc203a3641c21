"""Eval-mode accuracy probe: full attention computed next to the strategy on the same inputs.

`Shadow` wraps the run's strategy: every prefill/decode/append call goes to the strategy,
and the same q/k/v also go to a private `full` strategy (its own accelerator KV cache and
counters, so the run's traffic and token counts stay the strategy's own). The relative
error of the strategy's attention output against full attention, ||out - ref|| / ||ref||
(Frobenius, float32, over the whole [B, Hq, T, D] output), is counted per (step, layer) as
quantity "rel_error" (where "attention"), so it is stored per layer like the rest of the
trace.
Wrapping costs one dense attention per layer and step; eval-mode timings include it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvbench.strategies import NoParams, Strategy

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


class Shadow(Strategy):
    """The run's strategy plus a full-attention reference; not registered (not runnable)."""

    def __init__(self, inner: Strategy, ctx: RunContext) -> None:
        from kvbench.runtime.context import Counters
        from kvbench.strategies.full import Full

        super().__init__(inner.p, ctx)
        self.inner = inner
        c = ctx.counters
        private = Counters(c.kv_heads, c.elem_bytes, c.cuda)
        self.ref = Full(NoParams(), dataclasses.replace(ctx, counters=private))

    def begin_step(self, step: int) -> None:
        self.inner.begin_step(step)

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        self.inner.layer_input(layer, x)

    def _error(self, out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        import torch

        err = torch.linalg.vector_norm((out.float() - ref.float()).flatten())
        norm = torch.linalg.vector_norm(ref.float().flatten()).clamp_min(1e-30)
        self.ctx.counters.add("rel_error", "attention", float(err / norm))
        return out

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        return self._error(self.inner.prefill(layer, q, k, v), self.ref.prefill(layer, q, k, v))

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        return self._error(self.inner.decode(layer, q, k, v), self.ref.decode(layer, q, k, v))

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        return self._error(self.inner.append(layer, q, k, v), self.ref.append(layer, q, k, v))
