"""PNM-KV: the whole KV cache, page selection and attention on the CXL-PNM device role.

CXL-PNM (arXiv 2511.00321) section 3.1-3.2, Fig. 6(b), spec sheet section 5: the GPU runs
only the dense layers (QKV, O, FFN, LM head) and ships each layer's q/k/v to the PNM, which
keeps every page in CXL memory with a min/max digest, scores the pages with the query
(max of q.min, q.max per channel), sorts them and attends the top T_Budget tokens; only
the attention output comes back. Nothing is recalled to the GPU. The device role is host
memory on `--device-node` and host threads (kvbench.strategies._pnm), its work filed under
"pnm" in the trace; `--devices`/`--parallel` split it over several devices (Fig. 7).

Selection, as ArkVale (the paper's baseline) and Quest do it: pages of S tokens, the
`--sinks` first and `--window-pages` last pages (the current partial page included) always
selected, the top of the rest by the group-summed score within `--budget-tokens`, one set
per KV head (on the CPU in one native call, Quest's: kvbench.kernels.cpu.page_select). The
paper states neither T_Budget nor the page size: ArkVale's defaults (4096, 32) are used and
recorded. The first `--dense-layers` layers attend every token, still on the device.
Prefill and multi-turn appends attend densely on the accelerator (the paper reports decode
only) and write their KV to the device.

Exact setting: a budget covering the context (every page selected). Fidelity (no public code;
one ranking per KV head where section 3.2 reads as one per request): docs/fidelity/pnm-kv.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbench.strategies import STRATEGIES, Strategy, position_mask
from kvbench.strategies._pages import attend_selected, check_layers
from kvbench.strategies._pnm import (
    PNM_METRICS,
    DeviceKV,
    PnmParams,
    check_device_fit,
    resolve_node,
)

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


@STRATEGIES.register
class PnmKV(Strategy):
    """PNM-KV: all KV, page selection and attention on the CXL-PNM device role (host memory)."""

    name = "pnm-kv"
    version = "1"
    params = PnmParams
    exact = (("budget_tokens", 1 << 20),)  # every page selected
    sparse = (("budget_tokens", 32), ("page_size", 8), ("sinks", 1), ("window_pages", 1))
    metrics = PNM_METRICS

    @classmethod
    def for_run(cls, params: PnmParams, max_len: int) -> tuple[PnmParams, list[str]]:
        return resolve_node(params)

    @classmethod
    def placement(cls, params: PnmParams, ctx: RunContext) -> dict[str, int]:
        kv = ctx.batch * ctx.max_len * ctx.spec.kv_bytes_per_token(ctx.elem_bytes,
                                                                   ctx.n_layers)
        check_device_fit(params, ctx, kv)
        return {"accel": cls.accel_bytes(params, ctx), "host": kv + -(-kv // params.page_size)}

    @classmethod
    def accel_bytes(cls, params: PnmParams, ctx: RunContext) -> int:
        """KV bytes the accelerator holds (PNM-KV: none)."""
        return 0

    def __init__(self, params: PnmParams, ctx: RunContext) -> None:
        super().__init__(params, ctx)
        check_layers(params.dense_layers, ctx.n_layers)
        self.dev = DeviceKV(params, ctx)
        # layer -> (positions [B, Hkv, n], lengths [B, Hkv]) of its last decode's budget set
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def attended(self, layer: int) -> torch.Tensor | None:
        """Bool [B, Hq, n] on the accelerator (where eval mode's reference runs), though the
        device role's positions live on the host."""
        import torch

        n, hq = self.dev.length[layer], self.ctx.spec.n_heads
        sel = self.last.get(layer)
        if sel is None:  # dense
            return torch.ones(self.ctx.batch, hq, n, dtype=torch.bool, device=self.ctx.accel)
        return position_mask(sel[0], n, hq, sel[1]).to(self.ctx.accel)

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """T new tokens: dense causal attention on the accelerator over the cache (read
        back from the device) and themselves; their k/v are written to the device."""
        from kvbench.kernels.attention import dense_attention

        dev = self.dev
        n0 = dev.length[layer]
        n = dev.write(layer, k, v)
        out, _ = dense_attention(q, dev.k[layer][:, :, :n].to(q.device),
                                 dev.v[layer][:, :, :n].to(q.device))
        counters = self.ctx.counters
        counters.attended("accel", q, n)
        counters.moved("h2d", 2.0 * q.shape[0] * dev.hkv * n0 * dev.d * self.ctx.elem_bytes)
        self.last[layer] = None
        return out

    prefill = append  # the first prompt: an append onto the empty cache

    def _budget(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                select: Callable[[DeviceKV, int, torch.Tensor, int], Any]) -> tuple[int, Any]:
        """Write the token, then the device's selection `select(dev, layer, q, n)`
        (`DeviceKV.select` or `DeviceKV.select_tokens`): (n, what it returns), None for a
        dense layer."""
        dev = self.dev
        n = dev.write(layer, k, v)
        dev.query_in(q)
        if layer < self.p.dense_layers:
            self.last[layer] = None
            return n, None
        with self.ctx.counters.timed("bookkeeping.pnm_select"):
            return n, select(dev, layer, q, n)

    def _device_attention(self, layer: int, q: torch.Tensor,
                          sel: tuple[torch.Tensor, torch.Tensor] | None, n: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention on the device over positions sel = (pos [B, Hkv, m], lens [B, Hkv])
        (None: all n tokens): (out [B, Hq, 1, D], lse [B, Hq, 1]) on the device."""
        import torch

        from kvbench.kernels.attention import dense_attention

        dev, counters = self.dev, self.ctx.counters
        kd, vd = dev.k[layer][:, :, :n], dev.v[layer][:, :, :n]
        qd = q.to(kd.device)
        with counters.timed("pnm.attention"):
            if sel is None:
                counters.attended("pnm", q, n)
                dev.count_load(torch.full((q.shape[0], dev.hkv), n))
                return dense_attention(qd, kd, vd, causal=False)
            pos, lens = sel
            dev.count_load(lens)
            return attend_selected(qd, kd, vd, pos, lens, counters, where="pnm")

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """One token: the device selects the budget pages and attends them."""
        n, sel = self._budget(layer, q, k, v, DeviceKV.select_tokens)
        self.last[layer] = sel
        out, _ = self._device_attention(layer, q, sel, n)
        self.dev.activations_back(q.shape[0], lse=False)
        return out.to(q.device)
