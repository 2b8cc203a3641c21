"""Compact decoders in the spirit of gpt-fast: one readable implementation per family.

Module names mirror the Hugging Face checkpoints of each family (after the "model.",
"model.decoder." or "gpt_neox." prefix), so a checkpoint loads with `load_state_dict`.
Every attention call goes through the run's strategy (kvbench.strategies): the layer
computes q [B, Hq, T, D] and k/v [B, Hkv, T, D] with positions applied and hands them to
`Strategy.prefill` (first call, start 0, T = prompt length), `Strategy.decode` (T = 1) or
`Strategy.append` (a later turn's prompt after the cached tokens, T >= 2).

Only the last position's logits are computed ([B, vocab]): the run needs no others.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.models import ModelSpec

if TYPE_CHECKING:
    from kvbench.runtime.context import Counters
    from kvbench.strategies import Strategy


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 like the reference implementation."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(spec: ModelSpec, max_len: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, rot] for the rotated part (rot = head_dim * rotary_pct)."""
    rot = int(spec.head_dim * spec.rotary_pct)
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    if spec.llama3_rope:  # Llama 3.1: factor 8, low/high frequency factors 1 and 4, 8192
        wavelen = 2 * math.pi / inv
        smooth = ((8192 / wavelen) - 1) / (4 - 1)
        mid = (1 - smooth) * inv / 8 + smooth * inv
        inv = torch.where(wavelen > 8192, inv / 8, torch.where(wavelen < 8192 / 4, inv, mid))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv).float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [B, H, T, D] (rotate-half convention)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    xr = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([xr, xp], dim=-1) if xp.shape[-1] else xr


class Decoder(nn.Module):
    """Shared driver: embed, run the layers with the strategy, final norm, last logits."""

    layers: nn.ModuleList

    def __init__(self, spec: ModelSpec, n_layers: int) -> None:
        super().__init__()
        self.spec = spec
        self.n_layers = n_layers
        self.strategy: Strategy | None = None
        self.counters: Counters | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def setup(self, strategy: Strategy, counters: Counters, max_len: int) -> None:
        """Attach the run's strategy and counters; build RoPE tables up to max_len."""
        self.strategy, self.counters = strategy, counters
        if self.spec.family != "opt":
            w = next(self.parameters())
            self._rope = rope_tables(self.spec, max_len, w.device, w.dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start: int) -> torch.Tensor:
        """Positions on q/k [B, H, T, D], then the strategy; returns [B, T, Hq * D]."""
        if self._rope is not None:
            cos, sin = (t[start:start + q.shape[2]] for t in self._rope)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        with self.counters.timed("attention"):
            if start == 0:
                out = self.strategy.prefill(layer, q, k, v)
            elif q.shape[2] == 1:
                out = self.strategy.decode(layer, q, k, v)
            else:
                out = self.strategy.append(layer, q, k, v)
        b, h, t, d = out.shape
        return out.transpose(1, 2).reshape(b, t, h * d)

    def query(self, layer: int, x: torch.Tensor, start: int) -> torch.Tensor:
        """Layer `layer`'s query [B, Hq, T, D] from a normed hidden state x [B, T, hidden]
        at positions start..start+T-1, positions applied as `attend` applies them.

        What look-ahead strategies (InfiniGen, ScoutAttention) use to predict layer i+1's
        query from layer i's input (spec section 0: the predicted query needs RoPE).
        """
        q = self.layers[layer].q_heads(x)
        if self._rope is not None:
            cos, sin = (t[start:start + q.shape[2]] for t in self._rope)
            q = apply_rope(q, cos, sin)
        return q

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [B, T] at positions start..start+T-1 -> logits of the last one [B, vocab]."""
        x = self.embed(tokens, start)
        for i, layer in enumerate(self.layers):
            self.counters.layer = i
            x = layer(x, i, self, start)
        return self.logits(x[:, -1]).float()


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, n * D] -> [B, n, T, D]."""
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)


# --- Llama family (Llama 2/3, Qwen3, SmolLM2): RoPE, RMSNorm, SwiGLU, GQA ---------------

class LlamaAttention(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        d = s.head_dim
        self.q_proj = nn.Linear(s.hidden, s.n_heads * d, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(s.n_heads * d, s.hidden, bias=False)
        self.q_norm = RMSNorm(d, s.norm_eps) if s.qk_norm else None
        self.k_norm = RMSNorm(d, s.norm_eps) if s.qk_norm else None
        self.s = s

    def q_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Query heads [B, Hq, T, D] of x [B, T, hidden], q-norm applied, no positions."""
        q = _heads(self.q_proj(x), self.s.n_heads)
        return q if self.q_norm is None else self.q_norm(q)

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        q = self.q_heads(x)
        k = _heads(self.k_proj(x), self.s.n_kv_heads)
        v = _heads(self.v_proj(x), self.s.n_kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self.o_proj(m.attend(i, q, k, v, start))


class LlamaMLP(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(s)
        self.mlp = LlamaMLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.norm_eps)

    def q_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn.q_heads(x)

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        m.strategy.layer_input(i, h)
        x = x + self.self_attn(h, i, m, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaDecoder(Decoder):
    def __init__(self, s: ModelSpec, n_layers: int) -> None:
        super().__init__(s, n_layers)
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(LlamaLayer(s) for _ in range(n_layers))
        self.norm = RMSNorm(s.hidden, s.norm_eps)
        self.lm_head = None if s.tied else nn.Linear(s.hidden, s.vocab, bias=False)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.norm(x) @ w.T


# --- OPT: learned positions (offset 2), pre-LayerNorm, ReLU, biases, tied head ----------

class OPTAttention(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(s.hidden, s.hidden) for _ in range(4))
        self.n = s.n_heads

    def q_heads(self, x: torch.Tensor) -> torch.Tensor:
        return _heads(self.q_proj(x), self.n)

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        q, k, v = (_heads(p(x), self.n) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(m.attend(i, q, k, v, start))


class OPTLayer(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.self_attn = OPTAttention(s)
        self.self_attn_layer_norm = nn.LayerNorm(s.hidden)
        self.fc1 = nn.Linear(s.hidden, s.ffn)
        self.fc2 = nn.Linear(s.ffn, s.hidden)
        self.final_layer_norm = nn.LayerNorm(s.hidden)

    def q_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn.q_heads(x)

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        m.strategy.layer_input(i, h)
        x = x + self.self_attn(h, i, m, start)
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class OPTDecoder(Decoder):
    def __init__(self, s: ModelSpec, n_layers: int) -> None:
        super().__init__(s, n_layers)
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.embed_positions = nn.Embedding(s.ctx + 2, s.hidden)
        self.layers = nn.ModuleList(OPTLayer(s) for _ in range(n_layers))
        self.final_layer_norm = nn.LayerNorm(s.hidden)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start + 2, start + 2 + tokens.shape[1], device=tokens.device)
        return self.embed_tokens(tokens) + self.embed_positions(pos)[None]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(x) @ self.embed_tokens.weight.T


# --- GPT-NeoX: parallel residual, partial rotary, fused qkv, GELU -----------------------

class NeoXAttention(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(s.hidden, 3 * s.hidden)
        self.dense = nn.Linear(s.hidden, s.hidden)
        self.n = s.n_heads

    def q_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The query third of each head's fused [q | k | v] rows: [B, H, T, D]."""
        w = self.query_key_value.weight.view(self.n, 3, -1, x.shape[-1])[:, 0]
        bias = self.query_key_value.bias.view(self.n, 3, -1)[:, 0]
        return _heads(F.linear(x, w.reshape(-1, x.shape[-1]), bias.reshape(-1)), self.n)

    def forward(self, x: torch.Tensor, i: int, m: Decoder, start: int) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, self.n, -1).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)  # per head [q | k | v], as the checkpoints store it
        return self.dense(m.attend(i, q, k, v, start))


class NeoXLayer(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(s.hidden, eps=s.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(s.hidden, eps=s.norm_eps)
        self.attention = NeoXAttention(s)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = nn.Linear(s.hidden, s.ffn)
        self.mlp.dense_4h_to_h = nn.Linear(s.ffn, s.hidden)

    def q_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention.q_heads(x)

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
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.embed_in(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_layer_norm(x))


FAMILIES: dict[str, type[Decoder]] = {"llama": LlamaDecoder, "opt": OPTDecoder,
                                      "neox": NeoXDecoder}
