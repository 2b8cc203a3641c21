"""Greedy decoding's argmax (probes/greedy.c through kvbench.kernels.cpu.greedy) against
torch.argmax: the first maximal value, a NaN above every number, -inf rows, ties, rows
shorter than the threads, one to three threads, both instruction sets; what it does not
take goes to torch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbench.kernels import cpu  # noqa: E402

needs_native = pytest.mark.skipif(cpu._lib() is None, reason="native library not built")


def _rows(kind: str, b: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, generator=g)
    if kind == "ties":  # few distinct values: the first of the maxima must win
        x = (x * 2).round()
    elif kind == "nan":  # the first NaN wins, wherever the maximum is
        x[0, n // 2] = float("nan")
        x[-1, n - 1] = float("nan")
        x[-1, n // 3] = float("nan")
    elif kind == "-inf":
        x[:] = float("-inf")
    elif kind == "inf":
        x[:, n - 1] = float("inf")
        x[:, n // 2] = float("inf")
    return x


@needs_native
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "-inf", "inf"])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 1000, 49152])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("isa", [-1, 0])
def test_greedy_equals_torch_argmax(kind: str, n: int, threads: int, isa: int) -> None:
    x = _rows(kind, 4, n, n * 7 + threads)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu.greedy(x, isa)
    finally:
        torch.set_num_threads(old)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))


def test_what_it_does_not_take_goes_to_torch() -> None:
    """bfloat16, a strided view, 1-D logits: torch's argmax, the same answer."""
    x = _rows("ties", 3, 40, 1)
    for t in (x.to(torch.bfloat16), x[:, ::2], x[0]):
        assert torch.equal(cpu.greedy(t), t.argmax(-1))


class _Spy:
    """The native library with its kvb_argmax calls counted (or failing, `rc`)."""

    def __init__(self, lib: object, rc: int | None = None) -> None:
        self.lib, self.rc, self.calls = lib, rc, 0

    def __getattr__(self, name: str) -> object:
        if name != "kvb_argmax":
            return getattr(self.lib, name)

        def call(*args: object) -> int:
            self.calls += 1
            return self.lib.kvb_argmax(*args) if self.rc is None else self.rc

        return call


@needs_native
def test_greedy_runs_natively_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU float32 row-major logits, a vocabulary of one entry too, take the one native
    call; what it does not take never reaches it."""
    spy = _Spy(cpu._lib())
    monkeypatch.setattr(cpu, "_lib", lambda: spy)
    for n in (1, 5, 49152):
        x = _rows("ties", 2, n, n)
        assert torch.equal(cpu.greedy(x), x.argmax(-1))
    assert spy.calls == 3
    x = _rows("random", 3, 40, 2)
    for t in (x.to(torch.bfloat16), x[:, ::2], x[0]):
        cpu.greedy(t)
    assert spy.calls == 3


@needs_native
def test_an_empty_vocabulary_fails_as_torch_does() -> None:
    x = torch.empty(2, 0)
    with pytest.raises(type(_torch_error(x))):
        cpu.greedy(x)


def _torch_error(x: torch.Tensor) -> Exception:
    try:
        x.argmax(-1)
    except Exception as e:  # whatever torch raises, greedy must raise too
        return e
    raise AssertionError("torch's argmax took an empty row")


@needs_native
def test_a_native_failure_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.errors import KvbenchError

    failing = _Spy(cpu._lib(), rc=-1)
    monkeypatch.setattr(cpu, "_lib", lambda: failing)
    with pytest.raises(KvbenchError, match=r"^native argmax: out of memory$"):
        cpu.greedy(torch.randn(2, 8))
