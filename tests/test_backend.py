"""Which attention backend ran is stated, never silent (issue 11.5)."""

from pathlib import Path
from typing import Any

import pytest
import torch

from kvbench.cli import main
from kvbench.envinfo import collect_env
from kvbench.errors import KvbenchError
from kvbench.kernels import cpu
from kvbench.kernels.attention import backend_use, dense_attention
from kvbench.native import native_status
from kvbench.probes import Probe, measure, run_and_store
from kvbench.schema import measured
from kvbench.store import load


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native library as if it were not built."""
    monkeypatch.setattr(cpu, "_lib", lambda: None)


def qkv(lq: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, lq, 16, generator=g).to(dtype),
            torch.randn(1, 2, 40, 16, generator=g).to(dtype),
            torch.randn(1, 2, 40, 16, generator=g).to(dtype))


def test_backend_use_per_phase() -> None:
    backend_use(reset=True)
    dense_attention(*qkv(1))
    dense_attention(*qkv(1), backend="torch")
    dense_attention(*qkv(40))  # prefill: beyond the native kernel's query length
    assert backend_use(reset=True) == {"decode": "native+torch", "prefill/append": "torch"}
    dense_attention(*qkv(1, torch.float16))
    assert backend_use(reset=True) == {"decode": "torch"}
    assert backend_use() == {}


def test_fallback_is_counted(no_native: None) -> None:
    backend_use(reset=True)
    dense_attention(*qkv(1))
    assert backend_use(reset=True) == {"decode": "torch"}


def run_records(tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / "r.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["run", "full", "--weights", "random", "--layers", "1", "--prompt-len", "40",
              "--gen-len", "2", "--threads", "1", "--out", str(out)])
    assert e.value.code == 0
    return load(out).records


def test_run_records_state_backend(tmp_path: Path) -> None:
    recs = run_records(tmp_path)
    assert recs and all(r["method"]["backend"] == {"decode": "native-step",
                                                   "prefill/append": "torch"} for r in recs)


def test_run_records_state_fallback(tmp_path: Path, no_native: None) -> None:
    recs = run_records(tmp_path)
    assert recs and all(r["method"]["backend"] == {"decode": "torch", "prefill/append": "torch"}
                        for r in recs)


class _AttnProbe(Probe):
    name = "attn-test"

    def run(self, config: Any):
        dense_attention(*qkv(1))
        yield measured("probe", self.name, "x", "s", "lower", [1.0])
        yield measured("probe", self.name, "y", "s", "lower", [1.0])  # no attention ran


def test_probe_records_state_backend(tmp_path: Path) -> None:
    path = run_and_store(_AttnProbe(), None, tmp_path / "p.jsonl")
    x, y = load(path).records
    assert x["method"]["backend"] == {"decode": "native"} and "backend" not in y["method"]
    # suites measure through the same function
    x, y = measure(_AttnProbe(), None)
    assert x.method["backend"] == {"decode": "native"} and "backend" not in y.method


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_native_kernels_share_torchs_openmp_runtime() -> None:
    """probes/attn.c runs on torch's thread pool: one OpenMP runtime in the process, the one
    torch loaded (a second runtime's threads would fight torch's spinning workers)."""
    from kvbench.native import lib, openmp_runtimes

    lib()
    omp = openmp_runtimes()
    assert len(omp) == 1, omp
    bundled = list((Path(torch.__file__).parent / "lib").glob("lib*omp*.so*"))
    if bundled:  # torch ships its own runtime: the kernels must use that one
        assert Path(omp[0]).resolve() in {p.resolve() for p in bundled}, (omp, bundled)
    assert native_status().endswith(f"OpenMP {omp[0]})")


def test_env_says_whether_native_loaded(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert native_status().startswith("loaded (ABI ")

    def stale() -> None:
        raise KvbenchError("native probes are stale: rebuild with `pip install -e .`")

    monkeypatch.setattr("kvbench.native.lib", stale)
    assert collect_env()["native_kernel"] == ("not loaded: native probes are stale: rebuild "
                                              "with `pip install -e .`")
    with pytest.raises(SystemExit) as e:
        main(["env"])
    assert e.value.code == 0
    assert "Native kernel not loaded: native probes are stale" in capsys.readouterr().out
