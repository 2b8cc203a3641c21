"""Prefix cache (CXL KV-storage paper section 2): chunk ids over the prefix, save/load
round trips on every tier, partial hits, LRU eviction and counters, the disk format's
refusals and atomic saves, a memory-only (CXL) node on a fake topology, and bad input."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from kvbench.errors import KvbenchError
from kvbench.memory import HostBuffer
from kvbench.prefix.cache import PrefixCache
from kvbench.prefix.tiers import TierSpec, parse_tier
from kvbench.topology import libnuma

CPU = torch.device("cpu")
META = {"model": "tiny", "layers": 2, "dtype": "float32", "kv_heads": 2, "head_dim": 4}
C = 4  # tokens per chunk
TOKEN_BYTES = 2 * 2 * 2 * 4 * 4  # k/v x layers x heads x dim x fp32


def kv_of(tokens: torch.Tensor, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer k/v [B, 2, n, 4]: a function of (row's token, position, layer) plus noise,
    so a wrong row, layer or position shows."""
    b, n = tokens.shape
    g = torch.Generator().manual_seed(seed)
    base = tokens[:, None, :, None].float() + torch.arange(n)[None, None, :, None] / 1000
    return [(base + layer + torch.randn(b, 2, n, 4, generator=g),
             -base - layer + torch.randn(b, 2, n, 4, generator=g)) for layer in range(2)]


def cache(spec: TierSpec, capacity: int = 1 << 20, meta: dict | None = None,
          buffer=None) -> PrefixCache:
    return PrefixCache(spec, capacity, C, meta or META, CPU, buffer)


def tiers(tmp_path: Path) -> list[TierSpec]:
    out = [TierSpec("accel"), TierSpec("disk", path=str(tmp_path / "d"))]
    if libnuma() is not None:
        out.append(TierSpec("host", node=0))
    (tmp_path / "d").mkdir()
    return out


def test_chunk_ids_hash_the_whole_prefix(tmp_path: Path) -> None:
    c = cache(TierSpec("accel"))
    t = list(range(100, 114))  # 14 tokens: 3 whole chunks, 2 left over
    ids = c.chunk_ids(t)
    assert len(ids) == 3 and len(set(ids)) == 3
    assert c.chunk_ids(t[:12]) == ids and c.chunk_ids([*t, 7, 7])[:3] == ids
    late = t.copy()
    late[9] = 0  # inside chunk 2: chunks 0 and 1 unchanged
    assert c.chunk_ids(late)[:2] == ids[:2] and c.chunk_ids(late)[2] != ids[2]
    early = t.copy()
    early[0] = 0  # chunk 0 changes every later id, though their own tokens are equal
    assert all(a != b for a, b in zip(c.chunk_ids(early), ids, strict=True))
    other = cache(TierSpec("accel"), meta={**META, "model": "other"})
    assert other.chunk_ids(t)[0] != ids[0]  # another model never matches


def test_round_trip_every_tier_partial_hits_and_batch_minimum(tmp_path: Path) -> None:
    """Saved then loaded KV is bitwise the saved KV; a request that diverges inside chunk 2
    loads chunks 0-1; a batch loads its shortest row's hit; a trailing partial chunk and
    tokens past `limit` are never loaded."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (2, 19), generator=gen)  # 4 whole chunks per row
    kv = kv_of(tokens)
    for spec in tiers(tmp_path):
        c = cache(spec)
        assert c.save(tokens, kv) == 2 * 16 * TOKEN_BYTES
        h, got = c.load(tokens, limit=19)
        assert h == 16
        for (k, v), (gk, gv) in zip(kv, got, strict=True):
            assert torch.equal(gk, k[:, :, :16]) and torch.equal(gv, v[:, :, :16])
        assert c.load(tokens, limit=13)[0] == 12  # whole chunks within the limit
        req = tokens.clone()
        req[1, 10] += 1  # row 1 diverges in chunk 2
        h, got = c.load(req, limit=19)
        assert h == 8 and torch.equal(got[1][0], kv[1][0][:, :, :8])
        miss = tokens.clone()
        miss[:, 0] += 1
        assert c.load(miss, limit=19)[0] == 0
        c.close()


def test_lru_eviction_supersede_reject_and_counters() -> None:
    """Room for two 8-token entries: a third evicts the least recently used (a lookup
    refreshes an entry); a longer save of the same conversation supersedes its old entry;
    an entry larger than the capacity is rejected; hits and misses count chunks."""
    c = cache(TierSpec("accel"), capacity=2 * 8 * TOKEN_BYTES)
    a, b, d = (torch.full((1, 8), x) + torch.arange(8) for x in (0, 100, 200))
    for t in (a, b):
        c.save(t, kv_of(t))
    assert c.load(a, 8)[0] == 8  # a is now the most recently used
    c.save(d, kv_of(d))
    assert c.stats.evictions == 1 and c.load(b, 8)[0] == 0 and c.load(a, 8)[0] == 8
    assert c.stats.hits == 2 + 2 + 0 and c.stats.misses == 2
    longer = torch.cat([a, a + 1], dim=1)[:, :12]  # a's 8 tokens + 4 more: 3 chunks
    c2 = cache(TierSpec("accel"), capacity=4 * 8 * TOKEN_BYTES)
    c2.save(a, kv_of(a))
    c2.save(longer, kv_of(longer))
    assert len(c2.entries) == 1 and c2.stats.superseded == 1 and c2.load(longer, 12)[0] == 12
    huge = torch.arange(40)[None]
    c.save(huge, kv_of(huge))
    assert c.stats.rejected == 1 and c.load(a, 8)[0] == 8  # nothing evicted for it


def test_disk_entries_persist_and_foreign_or_corrupt_files_are_refused(tmp_path: Path) -> None:
    spec = TierSpec("disk", path=str(tmp_path))
    t = torch.arange(8)[None]
    kv = kv_of(t)
    cache(spec).save(t, kv)
    later = cache(spec)  # a later run finds the entry through its header
    h, got = later.load(t, 8)
    assert h == 8 and torch.equal(got[0][0], kv[0][0])
    with pytest.raises(KvbenchError, match=r"foreign to this run .*model 'tiny' != 'other'"):
        cache(spec, meta={**META, "model": "other"})
    with pytest.raises(KvbenchError, match=r"foreign to this run .*dtype"):
        cache(spec, meta={**META, "dtype": "bfloat16"})
    (f,) = tmp_path.glob("*.kvc")
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # one payload byte
    f.write_bytes(bytes(data))
    with pytest.raises(KvbenchError, match="fails its checksum"):
        cache(spec).load(t, 8)
    f.write_bytes(b"not a cache file at all")
    with pytest.raises(KvbenchError, match="bad magic"):
        cache(spec)


def test_interrupted_save_leaves_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """A save stopped before its rename leaves only a temporary file, which no later
    cache takes for an entry."""
    spec = TierSpec("disk", path=str(tmp_path))
    t = torch.arange(8)[None]

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache(spec).save(t, kv_of(t))
    monkeypatch.undo()
    assert list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.kvc"))
    later = cache(spec)
    assert not later.entries and later.load(t, 8)[0] == 0


class FakeNodeBuffer:
    """A HostBuffer stand-in for a node this machine does not have: plain memory, the
    requested node remembered, placement reported as the fake topology would verify it."""

    nodes: ClassVar[list[int]] = []

    def __init__(self, node: int, size: int) -> None:
        self.node, self.size, self.pinned = node, size, False
        self.mem = torch.zeros(size, dtype=torch.uint8)
        self.placement = f"fake node {node}"
        FakeNodeBuffer.nodes.append(node)

    def tensor(self) -> torch.Tensor:
        return self.mem

    def close(self) -> None:
        self.mem = None


def test_cache_on_a_memory_only_node_of_a_fake_topology(fake_sysfs: Path) -> None:
    """host:2 of the fake machine is a CXL expander (memory, no CPUs): accepted as a tier,
    its arena requested on node 2, and a save/load goes through it."""
    from kvbench.topology import get_node

    spec = parse_tier("host:2", fake_sysfs)
    assert spec == TierSpec("host", node=2) and get_node(2, fake_sysfs).memory_only
    c = cache(spec, buffer=FakeNodeBuffer)
    assert FakeNodeBuffer.nodes == [2] and c.tier.placement == "fake node 2"
    t = torch.arange(12)[None]
    kv = kv_of(t)
    c.save(t, kv)
    h, got = c.load(t, 12)
    assert h == 12 and torch.equal(got[1][1], kv[1][1])


def test_bad_tiers(fake_sysfs: Path, tmp_path: Path) -> None:
    with pytest.raises(KvbenchError, match="NUMA node 5 does not exist"):
        parse_tier("host:5", fake_sysfs)
    empty = fake_sysfs / "sys/devices/system/node/node3"
    empty.mkdir()
    (empty / "meminfo").write_text("Node 3 MemTotal:       0 kB\n")
    with pytest.raises(KvbenchError, match="NUMA node 3 has no memory"):
        parse_tier("host:3", fake_sysfs)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions: use a path under a file
        ro = tmp_path / "file"
        ro.write_text("x")
    with pytest.raises(KvbenchError, match=r"cannot create|not a writable folder"):
        parse_tier(f"disk:{ro}/cache", fake_sysfs)
    with pytest.raises(KvbenchError, match="accel, host:N"):
        parse_tier("cxl", fake_sysfs)


@pytest.mark.skipif(libnuma() is None, reason="libnuma not available here")
def test_host_tier_is_placed_and_verified() -> None:
    c = cache(TierSpec("host", node=0), capacity=1 << 20)
    assert isinstance(c.tier.host, HostBuffer) and c.tier.placement == "verified"
    c.close()


@pytest.mark.gpu
@pytest.mark.skipif(libnuma() is None, reason="libnuma not available here")
def test_cuda_host_tier_is_pinned_and_round_trips() -> None:
    """On a GPU: the host:0 arena is page-locked (cudaHostRegister), loads land on the GPU
    bitwise equal to what was saved from it; a partial hit too (pinned rows: `transfer`
    refuses a strided or pageable source)."""
    cuda = torch.device("cuda")
    c = PrefixCache(TierSpec("host", node=0), 1 << 20, C, META, cuda)
    assert c.tier.pinned and c.tier.placement == "verified"
    t = torch.arange(12)[None]
    kv = [(k.to(cuda), v.to(cuda)) for k, v in kv_of(t)]
    c.save(t, kv)
    h, got = c.load(t, 12)
    assert h == 12 and got[0][0].is_cuda and torch.equal(got[0][0], kv[0][0])
    h, got = c.load(torch.cat([t[:, :8], torch.tensor([[1, 2, 3, 4]])], 1), 12)
    assert h == 8 and torch.equal(got[1][1], kv[1][1][:, :, :8])
    c.close()


def test_partial_hit_loads_contiguous_rows(tmp_path: Path, monkeypatch) -> None:
    """GPU audit finding 6: a partial hit reads [..., :m*C, :] of an entry, which is
    strided; the load copies it as one contiguous row per (layer, k/v, KV head) through
    `transfer`, and a whole-entry hit as one copy, on every tier."""
    from kvbench.prefix import cache as module

    calls: list[tuple[int, ...]] = []
    real = module.transfer

    def spy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(dst.shape))
        return real(dst, src)

    monkeypatch.setattr(module, "transfer", spy)
    for spec in tiers(tmp_path):
        c = cache(spec)
        tokens = torch.arange(200, 212)[None]  # 3 chunks
        kv = kv_of(tokens)
        c.save(tokens, kv)
        calls.clear()
        h, got = c.load(torch.cat([tokens[:, :8], torch.tensor([[1, 2, 3, 4]])], 1), 12)
        assert h == 8 and calls == [(8, 4)] * (2 * 2 * 2)  # layers x k/v x heads
        for (k, v), (gk, gv) in zip(kv, got, strict=True):
            assert torch.equal(gk, k[:, :, :8]) and torch.equal(gv, v[:, :, :8])
        calls.clear()
        h, got = c.load(tokens, 12)
        assert h == 12 and calls == [(2, 2, 2, 12, 4)]  # the whole entry, once
        assert torch.equal(got[1][0], kv[1][0])
        c.close()
