"""InfiniGen's top-k (probes/topk.c through kvbench.kernels.cpu.topk) against torch's
stable descending sort: the k largest, best first, ties by the lower index, NaN above every
number, -inf rows, k of 1 and of every element, strided rows, one to three threads; what it
does not take, `topk_ok` refuses."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbench.kernels import cpu  # noqa: E402

needs_native = pytest.mark.skipif(cpu._lib() is None, reason="native library not built")


def _rows(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    n = shape[-1]
    if kind == "ties":  # few distinct values: ties at the k-th value and inside the k
        x = (x * 2).round() + 0.5  # no zeros (-0 and +0 tie in torch, not here)
    elif kind == "nan":
        x[..., n // 2] = float("nan")
        x[..., n - 1] = float("nan")
    elif kind == "-inf":
        x[:] = float("-inf")
    elif kind == "inf":
        x[..., 0] = float("inf")
        x[..., n // 3] = float("-inf")
    elif kind == "exponents":  # keys that differ only in their low bits, and wide ranges
        x = x * torch.logspace(-30, 30, n)
        x[..., : n // 2] = 1.0 + torch.arange(n // 2) * 2.0 ** -23
    return x


def _expected(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, idx = x.sort(dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


@needs_native
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "-inf", "inf", "exponents"])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (2, 1), (17, 17), (100, 7), (1000, 999),
                                      (8000, 1024), (5000, 1)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_topk_equals_torch_stable_sort(kind: str, n: int, k: int, threads: int) -> None:
    x = _rows(kind, (2, 3, n), n * 7 + k + threads)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu.topk_ok(x, k)
        vals, idx = cpu.topk(x, k)
    finally:
        torch.set_num_threads(old)
    want_vals, want_idx = _expected(x, k)
    assert idx.dtype == torch.int64 and vals.shape == idx.shape == (2, 3, k)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(vals, want_vals, rtol=0, atol=0, equal_nan=True)


@needs_native
def test_strided_rows_and_a_single_row() -> None:
    """Rows a column slice of a wider tensor (rows ld apart) and one row alone."""
    wide = _rows("random", (4, 9, 300), 3)
    x = wide[:, :, :250]
    assert cpu.topk_ok(x, 40)
    for got, want in zip(cpu.topk(x, 40), _expected(x, 40), strict=True):
        assert torch.equal(got, want)
    one = wide[0, 0]
    for got, want in zip(cpu.topk(one, 5), _expected(one, 5), strict=True):
        assert torch.equal(got, want)


@needs_native
def test_rows_that_are_not_evenly_laid_out() -> None:
    """Two rows of a wider tensor (rows 300 apart, 250 read), one row whose first stride
    is 1 (a transposed column) and three rows that are one (an expanded row, stride 0)."""
    wide = _rows("random", (2, 300), 4)
    for x in (wide[:, :250], torch.randn(7, 1).t(), wide[:1, :50].expand(3, 50)):
        for got, want in zip(cpu.topk(x, 3), _expected(x, 3), strict=True):
            assert torch.equal(got, want)


def test_what_it_does_not_take() -> None:
    x = _rows("random", (2, 40), 1)
    assert not cpu.topk_ok(x.to(torch.bfloat16), 3)
    assert not cpu.topk_ok(x[:, ::2], 3)  # strided last dimension
    assert not cpu.topk_ok(x, 0)
    assert not cpu.topk_ok(x, 41)


@needs_native
@pytest.mark.parametrize(("n", "ok"), [((1 << 31) - 1, True), (1 << 31, False)])
def test_rows_of_2_31_elements_or_more_go_to_torch(n: int, ok: bool) -> None:
    """The native call indexes a row with int32: a stand-in row of n elements (no memory
    behind it) is taken below 2^31 only."""
    from types import SimpleNamespace

    row = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, shape=(n,),
                          stride=lambda dim: 1)
    assert cpu.topk_ok(row, 1024) is ok


@needs_native
def test_a_native_failure_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.errors import KvbenchError

    class Failing:
        def kvb_topk_rows(self, *args: object) -> int:
            return -1

    monkeypatch.setattr(cpu, "_lib", lambda: Failing())
    with pytest.raises(KvbenchError, match=r"^native top-k: out of memory$"):
        cpu.topk(torch.randn(2, 8), 3)
