"""A Llama decoder layer's dense work at decode in two native calls (probes/layer.c).

`pre(layer, x, rope, start)`: h = RMSNorm(x), q/k/v from the fused projection, RoPE on q
and k; `post(layer, x, a)`: x += a W_o^T, then the MLP block and its residual, in place.
Between them the run's strategy attends as on the module path (kvbench.models.decoder).
Each half is one OpenMP region on torch's threads where the module path dispatches about
twenty torch ops a layer and opens four regions (issue 26: a decode step's calls bounded,
the reference near its bytes bound). `ok(layer)` says whether a layer's weights suit it;
the decoder takes this path for decode rows (T = 1, B <= MAX_ROWS) of float32 CPU layers
without q/k norms, and the module path otherwise.

Shapes: x [B, 1, hidden] contiguous; h [B, 1, hidden]; q [B, Hq, 1, D]; k/v [B, Hkv, 1, D];
a [B, 1, Hq * D].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError
from kvbench.kernels.cpu import MAX_GEMV_ROWS, _lib, native_built
from kvbench.timing import kernel

if TYPE_CHECKING:
    import torch

    from kvbench.models.decoder import LlamaLayer

MAX_ROWS = MAX_GEMV_ROWS  # decode rows a call takes (probes/decode.h's MAX_B)


def ok(layer: LlamaLayer) -> bool:
    """Whether `layer` can take the native path: float32 CPU weights, row-major and
    contiguous (a weight laid out otherwise by kvbench.models.linear is not), no q/k norms,
    the library built."""
    import torch

    attn, mlp = layer.self_attn, layer.mlp
    ws = (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight,
          mlp.down_proj.weight, layer.input_layernorm.weight,
          layer.post_attention_layernorm.weight)
    return (attn.q_norm is None and attn.qkv_proj.bias is None and native_built()
            and all(w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous()
                    for w in ws))


def rope_at(rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor], start: int
            ) -> tuple[int, int, int]:
    """Addresses of position `start`'s rows of the RoPE tables (cos, sin) [max_len, 1, D]
    and of perm [D] (kvbench.models.decoder.rope_tables), as the native calls take them."""
    cos, sin, perm = rope
    row = start * cos.stride(0) * cos.element_size()
    return cos.data_ptr() + row, sin.data_ptr() + row, perm.data_ptr()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise KvbenchError(f"native decoder layer ({what}) failed ({rc})")


@kernel
def pre(layer: LlamaLayer, x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor], start: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, q, k, v) of decode rows x at position `start`; rope: (cos, sin, perm) of
    kvbench.models.decoder.rope_tables."""
    import torch

    attn, norm = layer.self_attn, layer.input_layernorm
    b, _, hidden = x.shape
    d = attn.nq // attn.hq
    h = torch.empty_like(x)
    q = torch.empty(b, attn.hq, 1, d)
    k = torch.empty(b, attn.hkv, 1, d)
    v = torch.empty(b, attn.hkv, 1, d)
    _check(_lib().kvb_llama_pre(
        x.data_ptr(), norm.weight.data_ptr(), norm.eps, attn.qkv_proj.weight.data_ptr(),
        *rope_at(rope, start), h.data_ptr(),
        q.data_ptr(), k.data_ptr(), v.data_ptr(), b, hidden, attn.hq, attn.hkv, d,
        torch.get_num_threads()), "pre")
    return h, q, k, v


@kernel
def post(layer: LlamaLayer, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x += a W_o^T, then x += MLP(RMSNorm(x)), in place; returns x."""
    import torch

    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    if not a.is_contiguous():
        a = a.contiguous()
    b, _, hidden = x.shape
    _check(_lib().kvb_llama_post(
        x.data_ptr(), a.data_ptr(), attn.o_proj.weight.data_ptr(), norm.weight.data_ptr(),
        norm.eps, mlp.gate_up_proj.weight.data_ptr(), mlp.down_proj.weight.data_ptr(), b,
        hidden, attn.nq, mlp.down_proj.weight.shape[1], torch.get_num_threads()), "post")
    return x
