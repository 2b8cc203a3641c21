"""The attention probe's workloads: pinned host KV leaves with its workload (GPU audit
finding 17), and the HGCA suite's attention grids hold only valid head pairs."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from kvbench.kernels import workload
from kvbench.kernels.workload import Point, Workload

REPO = Path(__file__).resolve().parents[1]


def test_pinned_copies_are_freed_before_the_host_cache_is_released(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When the owner dies its pinned copies are freed first (into torch's host cache),
    then the cache is released: the blocks reach the OS instead of staying cached."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t.clone())  # CPU stand-in
    refs: list[weakref.ref] = []
    at_release: list[list[bool]] = []
    monkeypatch.setattr(workload, "release_host_cache",
                        lambda: at_release.append([r() is not None for r in refs]))

    class Owner:
        held: list[torch.Tensor]

    owner = Owner()
    src = [torch.arange(4.0), torch.ones(2, 3)]
    owner.held = workload.pinned(src, owner)
    refs += [weakref.ref(t) for t in owner.held]
    assert all(torch.equal(a, b) and a is not b for a, b in zip(owner.held, src, strict=True))
    assert at_release == []
    del owner
    assert at_release == [[False, False]]  # both copies gone when the cache was released


def test_host_kv_is_the_older_part_of_the_device_kv() -> None:
    w = Workload(Point(2, 4, 2, 8, 16, 48, 1, "float32"), 0.5, 1, cuda=False)
    assert w.k_host.shape == w.v_host.shape == (2, 2, 48, 8)
    assert torch.equal(w.k_host, w.k_dev[:, :, :48]) and torch.equal(w.v_host, w.v_dev[:, :, :48])
    assert not torch.equal(w.k_host, w.v_host)


@pytest.mark.gpu
def test_cuda_workload_returns_its_pinned_host_kv() -> None:
    """On a GPU: a workload's pinned host KV (64 MiB here, pinned through torch's caching
    host allocator) is no longer held by the allocator, cached or not, once it dies."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    workload.release_host_cache()
    before = stats().get("allocated_bytes.current", 0)
    p = Point(1, 8, 8, 128, 1024, 16384, 1, "float16")
    w = Workload(p, 0.5, 1, cuda=True)
    assert w.k_host.is_pinned() and w.v_host.is_pinned()
    host = p.kv_bytes(p.host_tokens)  # 64 MiB
    assert stats()["allocated_bytes.current"] - before >= host
    torch.cuda.synchronize()
    del w
    assert stats()["allocated_bytes.current"] - before < host / 16  # out/lse may stay


def test_hgca_paper_attention_grids_are_valid() -> None:
    """GPU audit finding 17: Fig. 10's cases sweep OPT's matched (heads, KV heads) pairs;
    a heads x kv_heads product made 6 of 9 points fail the probe's check."""
    from kvbench.probes.attention import grid
    from kvbench.suite import load_suite, units

    pairs = set()
    for unit in units(load_suite(REPO / "suites" / "hgca-paper.toml")):
        if unit.case.kind == "probe" and unit.case.name == "attention":
            pairs |= {(p.heads, p.kv_heads) for p in grid(unit.case.build(unit.params))}
    assert pairs == {(32, 32), (40, 40), (56, 56)}  # grid() refuses a mismatched pair
