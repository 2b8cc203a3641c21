"""Prefix caching across memory tiers (CXL KV-storage paper, Tang et al.): `cache` (save,
load, chunk ids, LRU), `tiers` (accel, host:N, disk:PATH), `turns` (a multi-turn run's TTFT
as recompute, load and resident), `roi` (the paper's appendix model) and `serve` (a serving
simulation under a TTFT SLO)."""
