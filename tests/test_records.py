"""Run records: short dtype names (issue 11.12) and tokens attended per layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.kernels.workload import Point
from kvbench.probes import Probe, run_and_store
from kvbench.schema import Record, measured
from kvbench.store import load
from kvbench.units import dtype_name


def test_dtype_short_names() -> None:
    assert [dtype_name(t) for t in ("fp32", "BF16", "fp16", "float32", "bfloat16")] == [
        "float32", "bfloat16", "float16", "float32", "bfloat16"]
    with pytest.raises(KvbenchError, match="--dtype 'int8': one of float32, fp32"):
        dtype_name("int8")
    assert Point(1, 2, 1, 8, 4, 4, 1, "bf16").dtype == "bfloat16"


@dataclass(frozen=True)
class _Config:
    dtype: str


class _DtypeProbe(Probe):
    name = "dtype-test"

    def run(self, config: Any) -> Iterator[Record]:
        yield measured("probe", self.name, "x", "s", "lower", [1.0], {"dtype": config.dtype})


def test_probe_records_carry_torch_dtype_names(tmp_path: Path) -> None:
    path = run_and_store(_DtypeProbe(), _Config("bf16, fp32"), tmp_path / "p.jsonl")
    assert load(path).records[0]["params"]["dtype"] == "bfloat16,float32"


def test_run_dtype_alias_and_tokens_per_layer(tmp_path: Path) -> None:
    """`--dtype fp32` runs float32; full attention attends P + s tokens per layer and
    sequence at decode step s, whatever the layers and batch."""
    out = tmp_path / "r.jsonl"
    p, g = 8, 3
    with pytest.raises(SystemExit) as e:
        main(["run", "full", "--weights", "random", "--layers", "2", "--batch", "2",
              "--prompt-len", str(p), "--gen-len", str(g), "--dtype", "fp32", "--threads", "1",
              "--out", str(out)])
    assert e.value.code == 0
    recs = {r["metric"]: r for r in load(out).records}
    assert recs["tbt"]["params"]["dtype"] == "float32"
    tokens = recs["tokens_attended_per_step"]
    assert tokens["unit"] == "tokens/layer"
    assert tokens["samples"] == [p + s for s in range(1, g + 1)]


def test_run_bad_dtype_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["run", "full", "--weights", "random", "--layers", "1", "--dtype", "fp8"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == ("kvbench: error: --dtype 'fp8': one of float32, "
                                               "fp32, bfloat16, bf16, float16, fp16")
