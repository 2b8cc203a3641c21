"""A Llama decode step with full attention in one native call (probes/step.c).

Issue 26 asks for the reference itself near its bytes bound. Layer by layer
(kvbench.kernels.layer) a decode step makes three native calls a layer with Python and a
dozen small torch ops between them (the new k/v's cache writes, views, buffers), each call
a new OpenMP region: on the bundled model at batch 1 about 1.5 ms of a 15 ms step went to
the Python between the calls, and the weights' memory stream stalled at every one. Here the
whole step, every layer's norms, projections, RoPE, the new token's k/v written into the
cache, attention over the cache, the MLP, then the final norm and the logits head, runs in
one region whose threads meet at barriers.

Taken (`Step.build`) for decode rows of a model on the native layers (float32 CPU Llama
layers, kvbench.kernels.layer.ok) whose strategy attends every layer densely over its own
cache (`Strategy.dense_cache`: full attention), with a row-major float32 head; the strategy
then does its per-layer bookkeeping in `Strategy.decoded` and the decoder records the same
stage graph as layer by layer (each layer's attention timed inside the call, thread 0's
clock). Otherwise the decoder goes layer by layer.

Shapes: tokens [B, 1]; x [B, hidden]; caches [B, Hkv, max_len, D]; logits [B, vocab].
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError
from kvbench.kernels.attention import note_backend
from kvbench.kernels.cpu import _lib
from kvbench.timing import kernel

if TYPE_CHECKING:
    import torch

    from kvbench.models.decoder import LlamaDecoder


class Layer(ctypes.Structure):
    """probes/step.c's kvb_layer_t: one layer's weights, its cache and their strides."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("nw1", "wqkv", "wo", "nw2", "wgu", "wd",
                                                "kc", "vc")] + \
        [("ks", ctypes.c_int64 * 3), ("vs", ctypes.c_int64 * 3)]


def _usable(t: torch.Tensor) -> bool:
    import torch

    return t.device.type == "cpu" and t.dtype == torch.float32


class Step:
    """The native decode step of one model and one strategy's caches (pointers only: the
    decoder keeps it while that strategy is its own)."""

    def __init__(self, model: LlamaDecoder, layers: ctypes.Array[Layer], head: torch.Tensor,
                 q: torch.Tensor) -> None:
        self.model, self.layers, self.head = model, layers, head
        self.q = q  # [B, Hq, 1, D]: the shape the strategy's `decoded` counts with
        self.seconds = (ctypes.c_double * len(layers))()

    @classmethod
    def build(cls, model: LlamaDecoder) -> Step | None:
        """The step for `model` and its strategy, or None when either does not suit it."""
        import torch

        s, norm = model.strategy, model.norm
        head = model.tied()
        head = model.lm_head.weight if head is None else head
        if not (model.native_layers and _usable(head) and head.is_contiguous()
                and _usable(norm.weight) and all(
                    n.eps == norm.eps for x in model.layers
                    for n in (x.input_layernorm, x.post_attention_layernorm))):
            return None
        out = (Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            cache = s.dense_cache(i)
            if cache is None or not all(_usable(t) and t.stride(3) == 1 for t in cache[:2]):
                return None
            k, v, _ = cache
            a, m = layer.self_attn, layer.mlp
            out[i] = Layer(*(t.data_ptr() for t in (
                layer.input_layernorm.weight, a.qkv_proj.weight, a.o_proj.weight,
                layer.post_attention_layernorm.weight, m.gate_up_proj.weight,
                m.down_proj.weight, k, v)), tuple(k.stride()[:3]), tuple(v.stride()[:3]))
        a = model.layers[0].self_attn
        return cls(model, out, head, torch.empty(k.shape[0], a.hq, 1, a.nq // a.hq))

    def ready(self, tokens: torch.Tensor, start: int) -> bool:
        """Whether tokens [B, 1] are the caches' batch and every layer's cache holds exactly
        the positions before `start`."""
        s = self.model.strategy
        return tokens.shape[0] == self.q.shape[0] and all(
            s.dense_cache(i)[2] == start for i in range(len(self.layers)))

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [B, vocab] of decode rows tokens [B, 1] at position `start`; the strategy's
        `decoded` and the stage graph per layer follow."""
        m = self.model
        x = m.embed(tokens, start)[:, 0].contiguous()
        logits = self._run(x, start)
        note_backend("native", self.q)  # every layer's attention, in the call
        c, spec, rows = m.counters, m.spec, x.shape[0]
        for i in range(len(self.layers)):
            c.layer = i
            c.dense(spec, "pre", rows)
            m.strategy.decoded(i, self.q)
            c.elapsed("attention", self.seconds[i])
            c.dense(spec, "post", rows)
        c.dense(spec, "head", rows)
        return logits

    @kernel
    def _run(self, x: torch.Tensor, start: int) -> torch.Tensor:
        import torch

        m = self.model
        a, norm = m.layers[0].self_attn, m.norm
        d = a.nq // a.hq
        cos, sin, perm = m._rope
        row = start * cos.stride(0) * cos.element_size()  # position `start`'s table row
        logits = x.new_empty(x.shape[0], self.head.shape[0])
        rc = _lib().kvb_llama_step(
            self.layers, len(self.layers), x.data_ptr(), norm.eps, norm.weight.data_ptr(),
            self.head.data_ptr(), self.head.shape[0], logits.data_ptr(), cos.data_ptr() + row,
            sin.data_ptr() + row, perm.data_ptr(), d ** -0.5, start, x.shape[0],
            x.shape[1], a.hq, a.hkv, d, m.layers[0].mlp.down_proj.weight.shape[1],
            self.seconds, torch.get_num_threads())
        if rc != 0:
            raise KvbenchError(f"native decode step failed ({rc})")
        return logits
