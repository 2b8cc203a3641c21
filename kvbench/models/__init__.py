"""Model architecture specs with published dimensions, parameter counts and KV bytes/token.

Importing this module does not import torch (`kvbench list` reads it). The decoders live
in `kvbench.models.decoder`, weight loading in `kvbench.models.weights`.

Families: "llama" (RoPE, RMSNorm, SwiGLU, GQA; qwen3 adds per-head q/k RMSNorm), "opt"
(learned positions offset by 2, pre-LayerNorm, ReLU, biases), "neox" (parallel residual,
partial rotary, LayerNorm, GELU, fused qkv). Numbers are from each model's published
config.json (SmolLM2 confirmed against the bundled GGUF's metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KvbenchError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "llama", "opt" or "neox"
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden: int
    ffn: int
    vocab: int
    ctx: int
    head_dim: int = 0  # 0: hidden // n_heads
    rope_theta: float = 10000.0
    rotary_pct: float = 1.0  # fraction of head_dim rotated (neox: 0.25)
    llama3_rope: bool = False  # llama-3.1 frequency scaling (factor 8, 8192 original)
    qk_norm: bool = False  # qwen3
    tied: bool = False
    norm_eps: float = 1e-5
    hf_id: str = ""
    published_params: float = 0.0  # as announced, for the sanity test

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)

    @property
    def positions(self) -> str:
        return {"llama": "rope", "opt": "learned", "neox": "partial rope"}[self.family]

    @property
    def norm(self) -> str:
        return "rmsnorm" if self.family == "llama" else "layernorm"

    @property
    def activation(self) -> str:
        return {"llama": "swiglu", "opt": "relu", "neox": "gelu"}[self.family]

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        h, d = self.hidden, self.head_dim
        q, kv = self.n_heads * d, self.n_kv_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.family == "llama":
            return attn + 3 * h * self.ffn + 2 * h + (2 * d if self.qk_norm else 0)
        biases = q + 2 * kv + h + self.ffn + h
        return attn + 2 * h * self.ffn + biases + 4 * h  # two LayerNorms (weight + bias)

    def params(self, layers: int | None = None) -> int:
        """Parameters with the first `layers` layers (default all), embeddings included."""
        n = self.n_layers if layers is None else layers
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        if self.family == "opt":
            emb += (self.ctx + 2) * self.hidden
        final_norm = self.hidden * (1 if self.family == "llama" else 2)
        return emb + n * self.layer_params() + final_norm

    def kv_bytes_per_token(self, elem_bytes: int = 2, layers: int | None = None) -> int:
        """K and V bytes one token adds to the cache across `layers` layers (default all)."""
        n = self.n_layers if layers is None else layers
        return 2 * n * self.n_kv_heads * self.head_dim * elem_bytes


def _opt(name: str, layers: int, heads: int, hidden: int, published: float) -> ModelSpec:
    return ModelSpec(name, "opt", layers, heads, heads, hidden, 4 * hidden, 50272, 2048,
                     tied=True, hf_id=f"facebook/{name}", published_params=published)


def _llama(name: str, layers: int, heads: int, kv: int, hidden: int, ffn: int, vocab: int,
           ctx: int, theta: float, hf_id: str, published: float, **kw: object) -> ModelSpec:
    return ModelSpec(name, "llama", layers, heads, kv, hidden, ffn, vocab, ctx,
                     rope_theta=theta, hf_id=hf_id, published_params=published, **kw)


_SPECS = [
    _opt("opt-125m", 12, 12, 768, 125e6),
    _opt("opt-1.3b", 24, 32, 2048, 1.3e9),
    _opt("opt-6.7b", 32, 32, 4096, 6.7e9),
    _opt("opt-13b", 40, 40, 5120, 13e9),
    _opt("opt-30b", 48, 56, 7168, 30e9),
    _opt("opt-66b", 64, 72, 9216, 66e9),
    _llama("llama-2-7b", 32, 32, 32, 4096, 11008, 32000, 4096, 1e4,
           "meta-llama/Llama-2-7b-hf", 6.74e9),
    _llama("llama-2-13b", 40, 40, 40, 5120, 13824, 32000, 4096, 1e4,
           "meta-llama/Llama-2-13b-hf", 13.0e9),
    _llama("llama-3.1-8b", 32, 32, 8, 4096, 14336, 128256, 131072, 5e5,
           "meta-llama/Llama-3.1-8B", 8.03e9, llama3_rope=True),
    _llama("llama-3.1-70b", 80, 64, 8, 8192, 28672, 128256, 131072, 5e5,
           "meta-llama/Llama-3.1-70B", 70.6e9, llama3_rope=True),
    _llama("llama-3.1-405b", 126, 128, 8, 16384, 53248, 128256, 131072, 5e5,
           "meta-llama/Llama-3.1-405B", 405.9e9, llama3_rope=True),
    _llama("qwen3-8b", 36, 32, 8, 4096, 12288, 151936, 40960, 1e6, "Qwen/Qwen3-8B", 8.2e9,
           head_dim=128, qk_norm=True, norm_eps=1e-6),
    _llama("qwen3-14b", 40, 40, 8, 5120, 17408, 151936, 40960, 1e6, "Qwen/Qwen3-14B",
           14.8e9, head_dim=128, qk_norm=True, norm_eps=1e-6),
    _llama("qwen3-32b", 64, 64, 8, 5120, 25600, 151936, 40960, 1e6, "Qwen/Qwen3-32B",
           32.8e9, head_dim=128, qk_norm=True, norm_eps=1e-6),
    _llama("smollm2-135m", 30, 9, 3, 576, 1536, 49152, 8192, 1e5,
           "HuggingFaceTB/SmolLM2-135M-Instruct", 134.5e6, tied=True),
    ModelSpec("gpt-neox-20b", "neox", 44, 64, 64, 6144, 24576, 50432, 2048, rotary_pct=0.25,
              hf_id="EleutherAI/gpt-neox-20b", published_params=20.55e9),
]
MODELS: dict[str, ModelSpec] = {s.name: s for s in _SPECS}


def get_spec(name: str) -> ModelSpec:
    """The spec of a model by name; KvbenchError listing the known names otherwise."""
    if name not in MODELS:
        raise KvbenchError(f"unknown model '{name}' (known: {', '.join(MODELS)})")
    return MODELS[name]
