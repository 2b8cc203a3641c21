"""The prefix-cache experiment's machinery on fixture records (kvbench.experiment,
kvbench.derive, kvbench.present.pivot): times formatted as times with their min-max, a
ratio column, and the ROI model's records derived from measured TTFTs, labelled projected,
rendering to a golden table (tests/fixtures/experiment/prefix.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.errors import KvbenchError
from kvbench.experiment import Experiment, load_experiment, render
from kvbench.models import get_spec
from kvbench.prefix.roi import derived, prefill_flops

FIX = Path(__file__).parent / "fixtures" / "experiment"


def serve(metric: str, context: int, path: str, value: float) -> dict:
    """A `kvbench serve-sim` record of one request (batch 1) with two samples."""
    lo, hi = 0.9 * value, 1.1 * value
    return {"schema_version": 1, "kind": "run", "name": "serve-sim", "metric": metric,
            "unit": "s", "direction": "lower", "value": value, "status": "ok", "reason": "",
            "provenance": "measured", "params": {"model": "smollm2-135m", "context": context,
                                                 "new_ratio": 0.1, "slo": 0.4, "batch": 1,
                                                 "path": path},
            "samples": [lo, hi], "stats": {"min": lo, "max": hi, "p10": lo, "p90": hi},
            "git_commit": "abc1234def", "time": "2026-11-26T07:00:00+00:00"}


RECORDS = [serve(m, n, p, v) for n, scale in ((256, 1.0), (512, 3.0)) for p, parts in (
    ("recompute", (2e-6, 3.0)), ("host:0", (0.012, 0.6))) for m, v in (
    ("serve_ttft", scale * sum(parts)), ("serve_ttft_copy", scale * parts[0]),
    ("serve_ttft_compute", scale * parts[1]))]


@pytest.fixture
def exp() -> Experiment:
    """The fixture experiment, its records checked to be RECORDS."""
    got = (FIX / "prefix-records.jsonl").read_text()
    assert got == "".join(json.dumps(r) + "\n" for r in RECORDS)
    return load_experiment(FIX / "prefix.toml")


def test_prefix_fixture_renders_its_golden_table(exp: Experiment) -> None:
    assert render(exp) == (FIX / "prefix.md").read_text()


def test_the_roi_records_are_derived_from_the_measured_ttfts(exp: Experiment,
                                                             tmp_path: Path) -> None:
    """The derive rewrites its output from the other records: the committed fixture is
    what it computes; P = C0 / recompute TTFT, T_slo = 4 x it, T_load = the host:0 copy."""
    from kvbench.store import load

    d = exp.derivations[0]
    out = tmp_path / "roi.jsonl"
    type(d)(d.function, out, d.args).write(RECORDS)

    def rows(path: Path) -> list[tuple]:
        return [(r["metric"], r["params"]["inputs"], r["params"]["h"], r["value"])
                for r in load(path).records]

    assert rows(out) == rows(FIX / "prefix-roi.jsonl")
    recs = load(out).records
    assert {r["provenance"] for r in recs} == {"projected"}
    ours = next(r for r in recs if r["params"]["inputs"] == "measured")
    rc = 3.000002  # the recompute TTFT at 256 tokens
    assert ours["params"]["prefill_flops"] == prefill_flops(get_spec("smollm2-135m").params(),
                                                            256)
    assert ours["params"]["slo_s"] == pytest.approx(4 * rc)
    assert ours["params"]["load_s"] == pytest.approx(0.012)
    assert ours["params"]["gpu_flops"] == pytest.approx(ours["params"]["prefill_flops"] / rc)
    assert [r["metric"] for r in ours["method"]["inputs_from"]] == ["serve_ttft",
                                                                    "serve_ttft_copy"]


def test_derived_refuses_ambiguous_or_missing_inputs() -> None:
    with pytest.raises(KvbenchError, match="ROI inputs: 0 serve-sim serve_ttft_copy "
                                           "records of path disk"):
        derived(RECORDS, [1.0], 256, "disk", 4.0)
    twice = [*RECORDS, {**RECORDS[0], "params": {**RECORDS[0]["params"], "slo": 9.0}}]
    with pytest.raises(KvbenchError, match="ROI inputs: 2 serve-sim serve_ttft records"):
        derived(twice, [1.0], 256, "host:0", 4.0)
    assert derived(twice, [1.0], 256, "host:0", 4.0, match={"slo": 0.4})


def test_a_derive_writing_measured_records_is_refused(exp: Experiment, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import kvbench.prefix.roi as roi

    def measured(recs: list, **kw: object) -> list:
        out = derived(recs, **kw)
        out[0].provenance = "measured"
        return out

    monkeypatch.setattr(roi, "derived", measured)
    d = exp.derivations[0]
    out = tmp_path / "roi.jsonl"
    with pytest.raises(KvbenchError, match="its record prefix-roi roi_rps_per_gpu_base is "
                                           "not labelled projected"):
        type(d)(d.function, out, d.args).write(RECORDS)
    assert not out.exists()
