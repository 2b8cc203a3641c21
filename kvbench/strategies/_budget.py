"""The accelerator KV budget: one pair of options for every strategy that keeps KV there.

`--gpu-share` is the share of the KV (prompt + generated tokens) kept on the accelerator,
`--gpu-tokens` the same in tokens (0: use the share). h2o, streaming and hgca declare both
with these helpers, so the names, help and checks are the same everywhere (sparse
strategies that attend a fixed number of tokens per step take `--budget-tokens` instead).
`--budget`, h2o's and streaming's earlier name of the share, stays as a hidden alias.
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any

from kvbench.errors import require


def gpu_share(default: float, note: str = "") -> Any:
    """The `gpu_share` field of a params dataclass."""
    return field(default=default, metadata={
        "help": "Share of the KV (prompt + generated tokens) kept on the accelerator, in "
                f"(0, 1]{note}.", "aliases": ("budget",)})


def gpu_tokens(note: str = "") -> Any:
    """The `gpu_tokens` field of a params dataclass."""
    return field(default=0, metadata={
        "help": f"KV tokens kept on the accelerator (overrides --gpu-share when > 0{note})."})


def check(share: float, tokens: int) -> None:
    """One-line errors for a share outside (0, 1] or negative tokens."""
    require(0 < share <= 1, f"--gpu-share {share}: must be in (0, 1]")
    require(tokens >= 0, f"--gpu-tokens {tokens}: must be >= 0")


def kept(share: float, tokens: int, max_len: int, round_up: bool = False) -> int:
    """Accelerator KV tokens of a cache of max_len: `tokens` (at most max_len) when given,
    else the share of max_len rounded down (or up)."""
    if tokens:
        return min(tokens, max_len)
    n = share * max_len
    return math.ceil(n) if round_up else int(n)

