"""Eval-mode accuracy probe: full attention computed next to the strategy on the same inputs.

`Shadow` wraps the run's strategy: every prefill/decode/append call goes to the strategy,
and the same q/k/v also go to a private `full` strategy (its own KV cache and counters, so
the run's traffic and token counts stay the strategy's own). The relative error of the
strategy's attention output against full attention, ||out - ref|| / ||ref|| (Frobenius,
float32, over the whole [B, Hq, T, D] output), is counted per (step, layer) as quantity
"rel_error" (where "attention"), so it is stored per layer like the rest of the trace.
For strategies that say which positions a decode step attended (`Strategy.attended`), the
share of full attention's top-10 keys per query head among them is counted as quantity
"topk_recall" (Quest Fig. 4's recall rate).

The reference is computed outside the timed region (issue 11.4): a call only keeps copies of
its q/k/v `[B, H, T, D]` and the strategy's output, and the full-attention work runs at the
next `begin_step` (which the run calls before starting a step's clock, synchronising CUDA
after it) or at `flush` after the last step. A decode's attended mask is read there too
(GPU audit finding 12: hgca's `attended` joins its eviction worker and copies the mask to
the device, scout's syncs), from the state the step left: no call between a step's last
layer and the next `begin_step` changes which positions a layer's last decode attended
(a multi-turn run's prefix-cache hook only exports the KV), and each layer decodes once
per step. The step times are then the strategy's own but for those copies (four per layer
and step); the shadow's cache and copies still count in the process's peak memory, which
eval runs therefore do not report as the strategy's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
        # (step, layer, reference call, q, k, v, strategy output, whether a decode: its
        # attended mask is read at flush) not yet compared
        self._pending: list[tuple[int, int, Callable[..., torch.Tensor], torch.Tensor,
                                  torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []

    def begin_step(self, step: int) -> None:
        self.flush()
        self.inner.begin_step(step)

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        self.inner.layer_input(layer, x)

    def flush(self) -> None:
        """Run the deferred full-attention calls in order and count each output's error at
        the (step, layer) it belongs to, and a decode's top-key recall from the strategy's
        attended mask (read now, outside the step's clock)."""
        import torch

        c = self.ctx.counters
        now = c.step, c.layer
        for step, layer, call, q, k, v, out, decode in self._pending:
            mask = self.inner.attended(layer) if decode else None
            ref = call(layer, q, k, v)
            c.step, c.layer = step, layer
            err = torch.linalg.vector_norm((out.float() - ref.float()).flatten())
            norm = torch.linalg.vector_norm(ref.float().flatten()).clamp_min(1e-30)
            c.add("rel_error", "attention", float(err / norm))
            if mask is not None:
                c.add("topk_recall", "attention", self._recall(layer, q, mask))
        c.step, c.layer = now
        if self._pending and self.ctx.accel.type == "cuda":
            torch.cuda.synchronize()
        self._pending.clear()

    def _recall(self, layer: int, q: torch.Tensor, mask: torch.Tensor, top: int = 10
                ) -> float:
        """Share of full attention's `top` keys per query head (q [B, Hq, 1, D] over the
        reference cache) that the strategy attended (mask [B, Hq, n], on any device)."""
        import torch

        n = mask.shape[2]
        k = self.ref.k[layer][:, :, :n].float()
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [B, Hq, n, D]
        logits = torch.matmul(q.float(), k.transpose(-1, -2)).squeeze(2)  # [B, Hq, n]
        best = logits.topk(min(top, n), dim=-1).indices
        return float(mask.to(best.device).gather(2, best).float().mean())

    def _defer(self, ref: Callable[..., torch.Tensor], run: Callable[..., torch.Tensor],
               layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               decode: bool = False) -> torch.Tensor:
        """The strategy's `run`(layer, q, k, v); the reference `ref` (and for a decode the
        strategy's attended mask) waits for `flush`."""
        saved = q.clone(), k.clone(), v.clone()  # the caller may reuse its buffers
        out = run(layer, q, k, v)
        self._pending.append((self.ctx.counters.step, layer, ref, *saved, out.clone(),
                              decode))
        return out

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        return self._defer(self.ref.prefill, self.inner.prefill, layer, q, k, v)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        return self._defer(self.ref.decode, self.inner.decode, layer, q, k, v, decode=True)

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        return self._defer(self.ref.append, self.inner.append, layer, q, k, v)
