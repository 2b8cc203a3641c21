"""Compact decoders in the spirit of gpt-fast: one readable implementation per family.

Module names mirror the Hugging Face checkpoints of each family (after the "model.",
"model.decoder." or "gpt_neox." prefix), except the fused projections (`FUSED`: q/k/v in one
matmul, gate/up in one, as gpt-fast does): `fuse_checkpoint` concatenates the checkpoint's
rows, then the state dict loads with `load_state_dict`.
Every attention call goes through the run's strategy (kvbench.strategies): the layer
computes q [B, Hq, T, D] and k/v [B, Hkv, T, D] with positions applied and hands them to
`Strategy.prefill` (first call, start 0, T = prompt length), `Strategy.decode` (T = 1) or
`Strategy.append` (a later turn's prompt after the cached tokens, T >= 2).

Only the last position's logits are computed ([B, vocab]): the run needs no others.
Decode allocates nothing it can avoid: RoPE tables (positions up to the run's max length)
are built once in `setup`, q and k are rotated by one set of ops, residual adds are in place,
and on the CPU the weights take the layout that decodes fastest at the run's batch size
(kvbench.models.linear), chosen on the first forward of that batch size. A float32 Llama
layer on the CPU decodes in two native calls around its attention (kvbench.kernels.layer:
norms, projections, RoPE, MLP and residuals, one OpenMP region each): the bundled model's
decode step at batch 1 went from 938 to 426 torch ops and 18.1 to 16.2 ms (median of four
interleaved runs each, 2-core AMD EPYC Zen 5 VM, 2026-11-27). Where the strategy's decode is
one kvbench.kernels.step runs (full attention, Quest, StreamingLLM, ArkVale:
`Strategy.native_cache`), a decode step is one native call for every layer and the head
(`native_step`, the tokens' embedding rows looked up inside it): 2 torch ops a step, the
token's slice of the sequence and the logits buffer; the strategy then does its bookkeeping
(`Strategy.decoded`).
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.kernels import cpu
from kvbench.kernels import layer as native_layer
from kvbench.models import ModelSpec
from kvbench.models.linear import Linear, Packed, matmul, packed
from kvbench.timing import kernel

if TYPE_CHECKING:
    from kvbench.kernels.step import Step
    from kvbench.runtime.context import Counters
    from kvbench.runtime.prefill import Recorder
    from kvbench.strategies import Strategy


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 like the reference implementation."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu.rms_norm_ok(x, self.weight):  # decode on the CPU: one native call
            return cpu.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one op, bit-identical to the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(spec: ModelSpec, max_len: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos, signed sin [max_len, 1, D] and the rotate-half permutation [D] of `apply_rope`.

    The rotated part is rot = head_dim * rotary_pct dims; the rest has cos 1 and sin 0.
    sin carries rotate-half's sign: [-sin, sin] over the two halves of the rotated part.
    """
    d = spec.head_dim
    rot = int(d * spec.rotary_pct)
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    if spec.llama3_rope:  # Llama 3.1: factor 8, low/high frequency factors 1 and 4, 8192
        wavelen = 2 * math.pi / inv
        smooth = ((8192 / wavelen) - 1) / (4 - 1)
        mid = (1 - smooth) * inv / 8 + smooth * inv
        inv = torch.where(wavelen > 8192, inv / 8, torch.where(wavelen < 8192 / 4, inv, mid))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv).float()
    cos, sin = freqs.cos(), freqs.sin()
    ones, zeros = torch.ones(max_len, d - rot), torch.zeros(max_len, d - rot)
    cos = torch.cat([cos, cos, ones], dim=-1)
    sin = torch.cat([-sin, sin, zeros], dim=-1)
    half = rot // 2
    perm = torch.cat([torch.arange(half, rot), torch.arange(half), torch.arange(rot, d)])
    return cos[:, None].to(device, dtype), sin[:, None].to(device, dtype), perm.to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               perm: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [..., T, H, D] with cos/sin [T, 1, D] from `rope_tables`:
    x * cos + rotate_half(x) * sin, rotate_half being the permutation with sin's sign."""
    return torch.addcmul(x * cos, x.index_select(-1, perm), sin)


class Decoder(nn.Module):
    """Shared driver: embed, run the layers with the strategy, final norm, last logits.

    Look-ahead strategies reach any layer through `query(layer, x, start)` (q with positions,
    as that layer computes it) and `query_weight(layer)` (its W_q, a view of the fused
    projection).
    """

    layers: nn.ModuleList
    random_weights = False  # seeded random weights (kvbench.models.weights): no trained q

    def __init__(self, spec: ModelSpec, n_layers: int) -> None:
        super().__init__()
        self.spec = spec
        self.n_layers = n_layers
        self.strategy: Strategy | None = None
        self.counters: Counters | None = None
        self.recorder: Recorder | None = None  # records the prefill (kvbench.runtime.prefill)
        self._rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._at: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None
        self._batch = 0  # the batch size the weights are laid out for (0: none yet)
        self._head: Packed | None = None  # a tied head's weight in that layout
        self.native_layers = False  # decode rows take kvbench.kernels.layer (set by pack)
        # the native decode step (kvbench.kernels.step) of the strategy it was built for
        self._step: tuple[weakref.ref[Strategy], Step | None] | None = None

    def setup(self, strategy: Strategy, counters: Counters, max_len: int) -> None:
        """Attach the run's strategy and counters; build RoPE tables up to max_len."""
        self.strategy, self.counters = strategy, counters
        if self.spec.family != "opt":
            w = next(self.parameters())
            self._rope = rope_tables(self.spec, max_len, w.device, w.dtype)
            self._at = None

    def rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Positions start.. on x [B, T, H, D] (unchanged for learned positions)."""
        if self._rope is None:
            return x
        cos, sin, perm = self._rope
        t = x.shape[1]
        if self._at is None or self._at[0] != (start, t):  # one slice per step, not per layer
            self._at = ((start, t), cos[start:start + t], sin[start:start + t])
        return apply_rope(x, self._at[1], self._at[2], perm)

    def query_weight(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s W_q [Hq * D, hidden] (a view of its fused projection; neox: a copy)."""
        return self.layers[layer].attn().q_weight()

    @torch.inference_mode()
    def query(self, layer: int, x: torch.Tensor, start: int) -> torch.Tensor:
        """Layer `layer`'s query [B, Hq, T, D] from a normed hidden state x [B, T, hidden]
        at positions start..start+T-1, q-norm and positions applied as the layer applies them.

        What look-ahead strategies (InfiniGen, ScoutAttention) use to predict layer i+1's
        query from layer i's input (the predicted query needs RoPE); only the q rows of the
        fused projection are multiplied.
        """
        return self.layers[layer].attn().q(x, self, start)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start: int) -> torch.Tensor:
        """The strategy on q [B, Hq, T, D], k/v [B, Hkv, T, D]; returns [B, T, Hq * D].

        The stage graph (kvbench.runtime.trace) gets the layer's dense work around it."""
        rows = q.shape[0] * q.shape[2]
        self.counters.dense(self.spec, "pre", rows)
        with self.counters.timed("attention"):
            if start == 0 and self.recorder is not None:
                from kvbench.kernels.attention import prompt_attention

                with prompt_attention(q, k, v) as memo:
                    out = self.strategy.prefill(layer, q, k, v)
                self.recorder.add(q, k, v, memo.result)
            elif start == 0:
                out = self.strategy.prefill(layer, q, k, v)
            elif q.shape[2] == 1:
                out = self.strategy.decode(layer, q, k, v)
            else:
                out = self.strategy.append(layer, q, k, v)
        self.counters.dense(self.spec, "post", rows)
        b, h, t, d = out.shape
        return out.transpose(1, 2).reshape(b, t, h * d)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        raise NotImplementedError

    def embed_table(self) -> torch.Tensor | None:
        """The table [vocab, hidden] whose rows `embed` returns when it is a plain lookup
        (the native step copies them itself), else None."""
        return None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tied(self) -> torch.Tensor | None:
        """The embedding [vocab, hidden] a tied head multiplies by, else None."""
        return None

    @kernel
    def tied_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] @ embedding^T [B, vocab], through the packed copy if any."""
        return F.linear(x, self.tied()) if self._head is None else matmul(x, self._head, None)

    @torch.no_grad()
    def pack(self, batch: int) -> None:
        """Lay every `Linear` out for `batch` rows, and a copy of a tied head's weight (the
        embedding keeps its rows for lookups). Layouts that copy the weights are skipped
        unless twice the weights' bytes are free (a large model keeps `F.linear`). Decide
        whether decode rows take the native layers (`native_layers`)."""
        import psutil

        size = sum(p.numel() * p.element_size() for p in self.parameters())
        spare = psutil.virtual_memory().available > 2 * size
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.pack(batch, spare)
        tied = self.tied()
        self._head = None if tied is None or not spare else packed(tied, batch, spare)
        self._batch = batch
        self._step = None
        self.native_layers = batch <= native_layer.MAX_ROWS and self._rope is not None and all(
            isinstance(x, LlamaLayer) and native_layer.ok(x) for x in self.layers)

    def native_step(self, tokens: torch.Tensor, start: int) -> Step | None:
        """The native decode step (kvbench.kernels.step) when it takes tokens [B, T] at
        `start`: decode rows, the native layers, a strategy whose decode the step runs (built
        once per strategy)."""
        if tokens.shape[1] != 1 or start == 0 or not self.native_layers:
            return None
        if self._step is None or self._step[0]() is not self.strategy:
            from kvbench.kernels.step import Step

            self._step = (weakref.ref(self.strategy), Step.build(self))
        step = self._step[1]
        return step if step is not None and step.ready(tokens, start) else None

    def forward(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [B, T] at positions start..start+T-1 -> logits of the last one [B, vocab]."""
        if tokens.shape[0] != self._batch:
            self.pack(tokens.shape[0])
        self.counters.flush()  # the last native step's accounts, if no step end ran them
        step = self.native_step(tokens, start)
        if step is not None:  # one native call, no torch op to keep out of autograd
            return step(tokens, start)
        with torch.inference_mode():
            x = self.embed(tokens, start)
            for i, layer in enumerate(self.layers):
                self.counters.layer = i
                x = layer(x, i, self, start)
            self.counters.dense(self.spec, "head", x.shape[0])
            return self.logits(x[:, -1]).float()


class FusedQKV(nn.Module):
    """q, k and v in one matmul: `qkv_proj` holds the checkpoint's q_proj, k_proj and v_proj
    rows in that order (`FUSED`), so x [B, T, hidden] is read once per layer."""

    def __init__(self, s: ModelSpec, bias: bool) -> None:
        super().__init__()
        self.hq, self.hkv, self.nq = s.n_heads, s.n_kv_heads, s.n_heads * s.head_dim
        self.qkv_proj = Linear(s.hidden, (s.n_heads + 2 * s.n_kv_heads) * s.head_dim,
                                  bias=bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None

    def q_weight(self) -> torch.Tensor:
        return self.qkv_proj.weight[:self.nq]

    def q(self, x: torch.Tensor, m: Decoder, start: int) -> torch.Tensor:
        """q [B, Hq, T, D] alone for x [B, T, hidden], q-norm and positions on."""
        b, t, _ = x.shape
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[:self.nq]
        q = F.linear(x, self.q_weight(), bias).view(b, t, self.hq, -1)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return m.rope(q, start).transpose(1, 2)

    def qkv(self, x: torch.Tensor, m: Decoder, start: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] (views) for x [B, T, hidden], positions on."""
        b, t, _ = x.shape
        qkv = self.qkv_proj(x).view(b, t, self.hq + 2 * self.hkv, -1)
        q, k, v = qkv.split((self.hq, self.hkv, self.hkv), dim=2)
        if self.q_norm is not None and self.k_norm is not None:  # qwen3: before positions
            q, k = m.rope(self.q_norm(q), start), m.rope(self.k_norm(k), start)
        else:  # q and k rotated by one set of ops
            q, k = m.rope(qkv[:, :, :self.hq + self.hkv], start).split((self.hq, self.hkv), 2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


# fused module -> the checkpoint modules whose weight (and bias) rows it holds, in order
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_checkpoint(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                          dict[str, list[str]]]:
    """Checkpoint names (prefix stripped) -> this module's: the `FUSED` groups concatenated
    by rows. Also returns fused name -> the checkpoint names it holds, in row order."""
    out, parts = dict(sd), {}
    for name in sd:
        for fused, group in FUSED.items():
            head = f".{group[0]}."
            if head in name:
                pre, suf = name.split(head)
                names = [f"{pre}.{g}.{suf}" for g in group]
                parts[f"{pre}.{fused}.{suf}"] = names
                out[f"{pre}.{fused}.{suf}"] = torch.cat([out.pop(n) for n in names])
    return out, parts


# --- Llama family (Llama 2/3, Qwen3, SmolLM2): RoPE, RMSNorm, SwiGLU, GQA ---------------

class LlamaAttention(FusedQKV):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__(s, bias=False)
        self.o_proj = Linear(s.n_heads * s.head_dim, s.hidden, bias=False)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.norm_eps)

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        return self.o_proj(m.attend(i, *self.qkv(x, m, start), start))


class LlamaMLP(nn.Module):
    """SwiGLU with gate and up in one matmul (`gate_up_proj`: gate rows, then up rows)."""

    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = Linear(s.hidden, 2 * s.ffn, bias=False)
        self.down_proj = Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaLayer(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(s)
        self.mlp = LlamaMLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.norm_eps)

    def attn(self) -> FusedQKV:
        return self.self_attn

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        if m.native_layers and x.shape[1] == 1:
            return self.decode_native(x, i, m, start)
        h = self.input_layernorm(x)
        m.strategy.layer_input(i, h)
        x = x + self.self_attn(h, i, m, start)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))

    def decode_native(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        """The same layer for decode rows x [B, 1, hidden] in two native calls around the
        strategy's attention (kvbench.kernels.layer); x is updated in place."""
        h, q, k, v = native_layer.pre(self, x, m._rope, start)
        m.strategy.layer_input(i, h)
        return native_layer.post(self, x, m.attend(i, q, k, v, start))


class LlamaDecoder(Decoder):
    def __init__(self, s: ModelSpec, n_layers: int) -> None:
        super().__init__(s, n_layers)
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(LlamaLayer(s) for _ in range(n_layers))
        self.norm = RMSNorm(s.hidden, s.norm_eps)
        self.lm_head = None if s.tied else Linear(s.hidden, s.vocab, bias=False)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def embed_table(self) -> torch.Tensor | None:
        return self.embed_tokens.weight

    def tied(self) -> torch.Tensor | None:
        return self.embed_tokens.weight if self.lm_head is None else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.tied_logits(x) if self.lm_head is None else self.lm_head(x)


# --- OPT: learned positions (offset 2), pre-LayerNorm, ReLU, biases, tied head ----------

class OPTAttention(FusedQKV):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__(s, bias=True)
        self.out_proj = Linear(s.hidden, s.hidden)

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        return self.out_proj(m.attend(i, *self.qkv(x, m, start), start))


class OPTLayer(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.self_attn = OPTAttention(s)
        self.self_attn_layer_norm = nn.LayerNorm(s.hidden)
        self.fc1 = Linear(s.hidden, s.ffn)
        self.fc2 = Linear(s.ffn, s.hidden)
        self.final_layer_norm = nn.LayerNorm(s.hidden)

    def attn(self) -> FusedQKV:
        return self.self_attn

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        m.strategy.layer_input(i, h)
        x = x + self.self_attn(h, i, m, start)
        return x.add_(self.fc2(F.relu(self.fc1(self.final_layer_norm(x)))))


class OPTDecoder(Decoder):
    def __init__(self, s: ModelSpec, n_layers: int) -> None:
        super().__init__(s, n_layers)
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.embed_positions = nn.Embedding(s.ctx + 2, s.hidden)
        self.layers = nn.ModuleList(OPTLayer(s) for _ in range(n_layers))
        self.final_layer_norm = nn.LayerNorm(s.hidden)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        pos = self.embed_positions.weight[start + 2:start + 2 + tokens.shape[1]]
        return self.embed_tokens(tokens) + pos

    def tied(self) -> torch.Tensor | None:
        return self.embed_tokens.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.tied_logits(self.final_layer_norm(x))


# --- GPT-NeoX: parallel residual, partial rotary, fused qkv, GELU -----------------------

class NeoXAttention(nn.Module):
    """The checkpoint's own fused qkv: per head [q | k | v] rows."""

    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.query_key_value = Linear(s.hidden, 3 * s.hidden)
        self.dense = Linear(s.hidden, s.hidden)
        self.n = s.n_heads

    def q_weight(self) -> torch.Tensor:
        w = self.query_key_value.weight
        return w.view(self.n, 3, -1, w.shape[1])[:, 0].reshape(-1, w.shape[1])

    def q(self, x: torch.Tensor, m: Decoder, start: int) -> torch.Tensor:
        """The query third of each head's [q | k | v] rows: [B, H, T, D], positions on."""
        b, t, _ = x.shape
        bias = self.query_key_value.bias.view(self.n, 3, -1)[:, 0].reshape(-1)
        q = F.linear(x, self.q_weight(), bias).view(b, t, self.n, -1)
        return m.rope(q, start).transpose(1, 2)

    def qkv(self, x: torch.Tensor, m: Decoder, start: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k/v [B, H, T, D] for x [B, T, hidden], positions on q and k."""
        b, t, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, t, self.n, 3, -1).unbind(3)
        return (m.rope(q, start).transpose(1, 2), m.rope(k, start).transpose(1, 2),
                v.transpose(1, 2))

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        return self.dense(m.attend(i, *self.qkv(x, m, start), start))


class NeoXLayer(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(s.hidden, eps=s.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(s.hidden, eps=s.norm_eps)
        self.attention = NeoXAttention(s)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = Linear(s.hidden, s.ffn)
        self.mlp.dense_4h_to_h = Linear(s.ffn, s.hidden)

    def attn(self) -> NeoXAttention:
        return self.attention

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        m.strategy.layer_input(i, h)
        ff = self.mlp.dense_4h_to_h(F.gelu(self.mlp.dense_h_to_4h(
            self.post_attention_layernorm(x)), approximate="tanh"))
        return x + self.attention(h, i, m, start) + ff


class NeoXDecoder(Decoder):
    def __init__(self, s: ModelSpec, n_layers: int) -> None:
        super().__init__(s, n_layers)
        self.embed_in = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(NeoXLayer(s) for _ in range(n_layers))
        self.final_layer_norm = nn.LayerNorm(s.hidden, eps=s.norm_eps)
        self.lm_head = Linear(s.hidden, s.vocab, bias=False)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.embed_in(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_layer_norm(x))


FAMILIES: dict[str, type[Decoder]] = {"llama": LlamaDecoder, "opt": OPTDecoder,
                                      "neox": NeoXDecoder}
