"""Attention kernels: dense and per-head sparse attention with log-sum-exp, and the exact
LSE merge of two partial results (HGCA 3.3).

`dense_attention(q, k, v, causal=, scale=) -> (out, lse)`, `merge(o1, lse1, o2, lse2)` and
`sparse_attention(q, k, v, indices, ...) -> (out, lse)` are the stable API the model runtime
and the strategies call; see kvbench.kernels.attention and kvbench.kernels.sparse.
"""

from kvbench.kernels.attention import dense_attention, merge
from kvbench.kernels.sparse import Selection, pack_indices, sparse_attention

__all__ = ["Selection", "dense_attention", "merge", "pack_indices", "sparse_attention"]
