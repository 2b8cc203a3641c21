"""Run records: short dtype names (issue 11.12) and tokens attended per layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_usage_error, cli

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
    line = assert_usage_error(cli(["run", "full", "--weights", "random", "--layers", "1",
                                   "--dtype", "fp8"], capsys))
    assert line == ("kvbench: error: --dtype 'fp8': one of float32, fp32, bfloat16, bf16, "
                    "float16, fp16")


# --- the schema's constructors, field by field (issue 30) ---

def test_measured_value_is_the_median_and_every_field_is_set() -> None:
    r = measured("probe", "bw", "bandwidth", "GB/s", "higher", [3, 1.5, 2], {"size": 4096},
                 {"timer": "t"}, version="7")
    d = r.to_dict()
    assert d["value"] == 2.0 and d["samples"] == [3.0, 1.5, 2.0]
    assert all(type(s) is float for s in d["samples"])
    assert d["stats"]["median"] == 2.0 and d["stats"]["n"] == 3 and d["stats"]["max"] == 3.0
    assert (d["kind"], d["name"], d["metric"], d["unit"], d["direction"]) == (
        "probe", "bw", "bandwidth", "GB/s", "higher")
    assert d["params"] == {"size": 4096} and d["method"] == {"timer": "t"}
    assert (d["version"], d["status"], d["reason"], d["provenance"]) == ("7", "ok", "",
                                                                         "measured")
    assert d["schema_version"] == 1 and d["env_id"] == "" and d["git_dirty"] is False
    bare = measured("run", "x", "m", "", "lower", [1.0])
    assert bare.params == {} and bare.method == {} and bare.version == "1"


def test_from_timing_is_seconds_lower_is_better_with_its_method() -> None:
    from kvbench.schema import from_timing
    from kvbench.timing import Timing

    t = Timing((0.3, 0.1, 0.2), "perf_counter_ns", 2)
    r = from_timing("probe", "timer", t, {"n": 1})
    assert (r.metric, r.unit, r.direction, r.value) == ("time", "s", "lower", 0.2)
    assert r.method == t.method() and r.params == {"n": 1} and r.version == "1"
    r2 = from_timing("run", "x", t, metric="ttft", version="3")
    assert (r2.kind, r2.metric, r2.version, r2.params) == ("run", "ttft", "3", {})
    assert (r.kind, r.name, r2.name) == ("probe", "timer", "x")


def test_not_measured_says_why_and_has_no_value() -> None:
    from kvbench.schema import not_measured

    r = not_measured("probe", "bw", "pinned", "waived", "no CUDA", {"size": 1}, version="2")
    assert (r.value, r.unit, r.direction, r.status, r.reason) == (None, "", "none", "waived",
                                                                 "no CUDA")
    assert r.params == {"size": 1} and r.samples == [] and r.stats is None
    assert r.version == "2" and r.provenance == "measured"
    bare = not_measured("run", "x", "m", "error", "boom")
    assert (bare.kind, bare.name, bare.metric, bare.status, bare.reason) == (
        "run", "x", "m", "error", "boom")
    assert bare.params == {} and bare.version == "1" and r.name == "bw"


def test_record_key_sorts_params_and_defaults_provenance() -> None:
    from kvbench.schema import now_iso, record_key

    a = {"kind": "probe", "name": "bw", "metric": "m", "params": {"b": 2, "a": "x"}}
    assert record_key(a) == ("probe", "bw", "m", "measured", (("a", "'x'"), ("b", "2")))
    b = {**a, "provenance": "projected", "params": None}
    assert record_key(b) == ("probe", "bw", "m", "projected", ())
    stamp = now_iso()
    assert stamp.endswith("+00:00") and len(stamp) == 25  # UTC, to the second
