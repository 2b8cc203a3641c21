"""A prefix cache of finished requests' KV (CXL KV-storage paper section 2: save and load).

`save(tokens, kv)` is called once when a request (a turn) finishes: for every batch row,
all of that row's KV is copied to the tier in one copy, as one entry. `load(tokens)` is
called when a request's prefill begins: per row, the longest run of leading chunks whose
ids are cached is copied to the accelerator (partial prefix hits allowed), and the run
then prefills only the tokens after it. A batch loads the same number of tokens in every
row, the shortest row's hit (its rows are prefilled together).

Chunk ids follow vLLM's prefix caching: tokens are cut into chunks of `chunk` tokens (a
trailing partial chunk is never cached); chunk i's id is a hash of its tokens and chunk
i-1's id, the first chunk's parent being a hash of the model, its layers and dtype. Equal
ids mean equal prefixes, so a hit on chunk i implies hits on 0..i-1.

An entry's payload is one row's KV in the model dtype, laid out [L, 2 (k, v), Hkv, n, D]
(n = whole chunks of tokens); a hit on its first m chunks reads [..., :m*C, :] of it. The
index maps each chunk id to the newest entry holding it; an entry that no chunk id points
to any more (a later save of the same conversation holds all of it) is freed. When a save
does not fit, least-recently-used entries are evicted (`evictions`); an entry larger than
the whole capacity is not stored (`rejected`). `hits` and `misses` count chunks looked up.

A load copies each run of chunks with `strategies._hostcopy.transfer` (async from a pinned
tier on CUDA): a whole entry in one copy, a partial hit as one contiguous copy per (layer,
k/v, KV head) row, since [..., a:e, :] of an entry is strided and ATen would stage a strided
copy in pageable memory (GPU audit finding 6), so a record's "pinned" holds. The copies are
queued on the current stream, as is every later write to the tier (a save's D2H), so none
overwrites a range a load is still reading.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbench.errors import require
from kvbench.prefix.tiers import FORMAT_VERSION, DiskTier, MemoryTier, TierSpec, open_tier
from kvbench.strategies._hostcopy import transfer

if TYPE_CHECKING:
    import torch

KV = Sequence[tuple["torch.Tensor", "torch.Tensor"]]  # per layer (k, v) [B, Hkv, n, D]


@dataclass
class Entry:
    """One saved row: its chunk ids (in order) and payload bytes."""

    chunk_ids: list[str]
    nbytes: int


@dataclass
class Stats:
    """Counters of a cache's life (chunks for hits/misses, bytes for the rest)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    saves: int = 0
    evictions: int = 0
    rejected: int = 0
    superseded: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class PrefixCache:
    """KV of whole chunks of finished requests on one tier, LRU-evicted within `capacity`.

    meta: model, layers, dtype (torch name), kv_heads, head_dim: what a disk entry's header
    must match; `accel` is where loads land."""

    def __init__(self, spec: TierSpec, capacity: int, chunk: int, meta: dict[str, Any],
                 accel: torch.device, buffer: Any = None) -> None:
        import torch

        require(chunk >= 1, f"--prefix-chunk {chunk}: must be at least 1")
        self.chunk, self.meta, self.accel = chunk, dict(meta), accel
        self.dtype = getattr(torch, meta["dtype"])
        self.shape = (meta["layers"], 2, meta["kv_heads"])  # + (n, D)
        self.token_bytes = 2 * meta["layers"] * meta["kv_heads"] * meta["head_dim"] * \
            self.dtype.itemsize
        self.tier: MemoryTier | DiskTier = open_tier(spec, capacity, accel, buffer)
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self.index: dict[str, tuple[str, int]] = {}  # chunk id -> (entry, chunk slot)
        self.stats = Stats()
        self._root = hashlib.blake2b(repr(sorted(self.meta.items())).encode(),
                                     digest_size=16).digest()
        if isinstance(self.tier, DiskTier):  # entries of earlier runs, checked
            for key, header in self.tier.scan(self.header()):
                self.entries[key] = Entry(header["chunk_ids"], header["payload_bytes"])
                for slot, cid in enumerate(header["chunk_ids"]):
                    self.index[cid] = (key, slot)

    def header(self) -> dict[str, Any]:
        """What identifies this run's entries on disk (format version included)."""
        return {"format_version": FORMAT_VERSION, "chunk": self.chunk,
                "layout": "[layer, k/v, kv_head, token, dim]", **self.meta}

    def chunk_ids(self, tokens: Sequence[int]) -> list[str]:
        """Ids of the whole chunks of a token list, each hashed over its prefix."""
        import numpy as np

        ids, parent = [], self._root
        for i in range(len(tokens) // self.chunk):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(np.asarray(tokens[i * self.chunk:(i + 1) * self.chunk],
                                dtype=np.int64).tobytes())
            parent = h.digest()
            ids.append(h.hexdigest())
        return ids

    # -- save ---------------------------------------------------------------------------------

    def save(self, tokens: torch.Tensor, kv: KV) -> int:
        """Store each row of the finished request: tokens [B, n] whose KV is kv (per layer
        k/v [B, Hkv, >= n, D]); returns the bytes copied to the tier."""
        import torch

        moved = 0
        for b in range(tokens.shape[0]):
            ids = self.chunk_ids(tokens[b].tolist())
            if not ids:
                continue
            key = ids[-1]
            if key in self.entries:  # the same tokens are cached already
                self.entries.move_to_end(key)
                continue
            n = len(ids) * self.chunk
            payload = torch.stack([torch.stack([k[b, :, :n], v[b, :, :n]]).to(self.accel)
                                   for k, v in kv]).to(self.dtype).contiguous()
            data = payload.view(-1).view(torch.uint8)
            if not self._put(key, data, ids):
                self.stats.rejected += 1
                continue
            moved += data.numel()
            self.stats.saves += 1
            self.stats.bytes_saved += data.numel()
        return moved

    def _put(self, key: str, data: torch.Tensor, ids: list[str]) -> bool:
        """Store the payload, evicting LRU entries until it fits; index its chunks."""
        if data.numel() > self.tier.capacity:
            return False
        header = {**self.header(), "tokens": len(ids) * self.chunk, "chunk_ids": ids}
        while not self.tier.put(key, data, header):
            if not self.entries:
                return False
            self._drop(next(iter(self.entries)))
            self.stats.evictions += 1
        self.entries[key] = Entry(ids, data.numel())
        for slot, cid in enumerate(ids):
            self.index[cid] = (key, slot)
        live = {k for k, _ in self.index.values()}
        for old in [k for k in self.entries if k not in live]:  # wholly held by newer ones
            self._drop(old)
            self.stats.superseded += 1
        return True

    def _drop(self, key: str) -> None:
        ids = self.entries.pop(key).chunk_ids
        for cid in ids:
            if self.index.get(cid, ("", 0))[0] == key:
                del self.index[cid]
        self.tier.drop(key)

    # -- load ---------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> list[tuple[str, int, int]]:
        """(entry, first slot, end slot) runs covering the longest cached prefix of whole
        chunks of `tokens`, in order; counts the chunks as hits and misses."""
        ids = self.chunk_ids(tokens)
        runs: list[tuple[str, int, int]] = []
        hit = 0
        for cid in ids:  # chunk i's id names its whole prefix: it sits at slot i
            where = self.index.get(cid)
            if where is None:
                break
            key, slot = where
            if runs and runs[-1][0] == key:
                runs[-1] = (key, runs[-1][1], slot + 1)
            else:
                runs.append((key, slot, slot + 1))
            hit += 1
        self.stats.lookups += 1
        self.stats.hits += hit
        self.stats.misses += len(ids) - hit
        return runs

    def load(self, tokens: torch.Tensor, limit: int) -> tuple[int, KV]:
        """The cached prefix of a request's rows tokens [B, N], at most `limit` tokens:
        (h, per-layer k/v [B, Hkv, h, D] on the accelerator), h = the rows' shortest hit
        in whole chunks (0: a miss, nothing copied)."""
        import torch

        rows = [self.lookup(tokens[b, :limit].tolist()) for b in range(tokens.shape[0])]
        h = min(sum(e - s for _, s, e in r) for r in rows) * self.chunk
        if h == 0:
            return 0, []
        L, two, hkv = self.shape
        d = self.meta["head_dim"]
        staging = torch.empty(tokens.shape[0], L, two, hkv, h, d, dtype=self.dtype,
                              device=self.accel)
        for b, runs in enumerate(rows):
            t = 0
            for key, s0, s1 in runs:
                self.entries.move_to_end(key)
                n = len(self.entries[key].chunk_ids) * self.chunk
                src = self.tier.source(key).view(self.dtype).view(L, two, hkv, n, d)
                a, e = s0 * self.chunk, min(s1 * self.chunk, s0 * self.chunk + h - t)
                dst, part = staging[b, :, :, :, t:t + e - a], src[:, :, :, a:e]
                if dst.is_contiguous() and part.is_contiguous():  # the whole entry
                    transfer(dst, part)
                else:  # rows [e - a, D] of (layer, k/v, KV head), each contiguous
                    for d_row, s_row in zip(dst.flatten(0, 2).unbind(0),
                                            part.flatten(0, 2).unbind(0), strict=True):
                        transfer(d_row, s_row)
                t += e - a
                if t == h:
                    break
        self.stats.bytes_loaded += staging.numel() * staging.element_size()
        return h, [(staging[:, i, 0], staging[:, i, 1]) for i in range(L)]

    def close(self) -> None:
        self.tier.close()
