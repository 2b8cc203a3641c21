"""HGCA's MAW update on the native kernel (probes/maw.c through kvbench.kernels.cpu) against
the torch path it replaces on the CPU (decode_weights, then the moving average), and the
strategy's use of it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbench.kernels import cpu  # noqa: E402
from kvbench.strategies import decode_weights  # noqa: E402

pytestmark = pytest.mark.skipif(cpu._lib() is None, reason="native library not built")


@pytest.mark.parametrize("b, hq, hkv, n, d, slot", [
    (1, 9, 3, 512, 64, -1), (4, 9, 3, 512, 64, 17), (2, 4, 4, 37, 33, 36), (1, 8, 2, 1, 8, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_maw_update_matches_torch(b: int, hq: int, hkv: int, n: int, d: int, slot: int,
                                  threads: int) -> None:
    gen = torch.Generator().manual_seed(n + d)
    q = torch.randn(b, hq, 1, d, generator=gen)
    ring = torch.randn(b, hkv, n + 5, d, generator=gen)
    k = ring[:, :, 2:n + 2]  # a strided view, as a slice of a larger buffer is
    lse = torch.logsumexp(torch.einsum("bhd,bhnd->bhn", q[:, :, 0] * d ** -0.5,
                                       k.repeat_interleave(hq // hkv, dim=1)), dim=-1)[..., None]
    maw = torch.rand(b, hq, n, generator=gen)
    want = maw.clone()
    a = decode_weights(q, k, lse, scale=d ** -0.5)
    want.mul_(1 - 0.01).add_(a, alpha=0.01)
    if slot >= 0:
        want[:, :, slot] = a[:, :, slot]
    assert cpu.maw_ok(q, k, lse, maw)
    cpu.maw_update(q, k, lse, maw, scale=d ** -0.5, alpha=0.01, slot=slot, threads=threads)
    torch.testing.assert_close(maw, want, rtol=1e-5, atol=1e-6)


def test_where_the_native_maw_applies() -> None:
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 16, 8)
    lse, maw = torch.zeros(1, 4, 1), torch.zeros(1, 4, 16)
    assert cpu.maw_ok(q, k, lse, maw)
    assert not cpu.maw_ok(q.bfloat16(), k.bfloat16(), lse, maw)
    assert not cpu.maw_ok(torch.randn(1, 4, 2, 8), k, lse, maw)  # one query per head only
    assert not cpu.maw_ok(q, k, lse, torch.zeros(1, 4, 32)[:, :, ::2])
    assert not cpu.maw_ok(q, k.transpose(2, 3).contiguous().transpose(2, 3), lse, maw)


def test_hgca_decode_updates_its_maw_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU decode step of hgca updates each layer's MAW with one native call."""
    from test_offload_strategies import inputs, make

    from kvbench.strategies._hgca_kv import HgcaParams

    calls = []
    real = cpu.maw_update
    monkeypatch.setattr(cpu, "maw_update", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    s = make("hgca", HgcaParams(gpu_tokens=16, block=8), layers=1, batch=1)
    steps = inputs(20, 3, batch=1)
    s.prefill(0, *steps[0])
    for q, k, v in steps[1:]:
        s.decode(0, q, k, v)
    assert len(calls) == 3 and all(c["slot"] >= 0 for c in calls)  # authors: slot's weight
