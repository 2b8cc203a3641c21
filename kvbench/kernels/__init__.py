"""Attention kernels: dense attention with log-sum-exp, the exact LSE merge (HGCA 3.3).

`dense_attention(q, k, v, causal=, scale=) -> (out, lse)` and `merge(o1, lse1, o2, lse2)`
are the stable API the model runtime and the strategies call; see kvbench.kernels.attention.
"""

from kvbench.kernels.attention import dense_attention, merge

__all__ = ["dense_attention", "merge"]
