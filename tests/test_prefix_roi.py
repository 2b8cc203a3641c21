"""The CXL KV-storage paper's ROI model (appendix A.1): its section 3.4 numbers from its
inputs, the dependence on h it leaves out, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.prefix.roi import RoiInputs, roi


def test_paper_numbers() -> None:
    """Section 3.4: 62.5 TFLOP/s and 1.6 req/s per GPU without the cache; 8.3 TFLOP/s and
    12 req/s with it; 7.5x; 87% fewer GPUs (1 - 1/7.5, rounded)."""
    r = roi(RoiInputs(), 1.0)
    assert r.c1 == pytest.approx(2.5e12) and r.p0 == pytest.approx(62.5e12)
    assert r.r_base == pytest.approx(1.6) and r.p1 == pytest.approx(8.333e12, rel=1e-3)
    assert r.r_gpu == pytest.approx(12.0) and r.speedup == pytest.approx(7.5)
    assert round(100 * (1 - 1 / r.speedup)) == 87
    assert (r.n_base, r.n_cxl) == (63, 9)  # R = 100: ceil(62.5), ceil(8.33)


def test_follow_up_share() -> None:
    """h = 0: no follow-ups, no gain; h = 0.5 by hand: 100 / (62.5/2 + 8.333/2) = 2.8235."""
    assert roi(RoiInputs(), 0.0).speedup == pytest.approx(1.0)
    assert roi(RoiInputs(), 0.5).r_gpu == pytest.approx(100 / (31.25 + 25 / 6), rel=1e-9)
    assert roi(RoiInputs(load_s=0.0), 1.0).speedup == pytest.approx(10.0)  # 1 / r
    with pytest.raises(KvbenchError, match="follow-up share"):
        roi(RoiInputs(), 1.5)


@pytest.mark.parametrize("args, msg", [
    (["--slo", "0"], "the TTFT SLO must be above 0 s"),
    (["--load-time", "0.5"], "below the SLO"),
    (["--h", "0.5,x"], "comma-separated numbers"),
    (["--new-ratio", "0"], "--new-ratio 0.0"),
])
def test_cli_bad_input_exit_2(args, msg, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(cli(["roi", *args], capsys), msg)


@pytest.mark.parametrize("h", ["", " , "])
def test_cli_no_follow_up_share_is_an_error(h: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """An empty --h used to exit 0 and print `results: FILE` for a file never written."""
    out = tmp_path / "roi.jsonl"
    line = assert_usage_error(cli(["roi", "--h", h, "--out", str(out)], capsys))
    assert line == f"kvbench: error: --h '{h}' names no follow-up share: " \
                   "comma-separated numbers in [0, 1]"
    assert not out.exists()


def test_cli_records_are_projected(tmp_path: Path) -> None:
    out = tmp_path / "roi.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["roi", "--model", "smollm2-135m", "--tokens", "1000", "--gpu-tflops", "1",
              "--h", "1", "--out", str(out)])
    assert e.value.code == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()][1:]
    assert {r["provenance"] for r in recs} == {"projected"}
    from kvbench.models import get_spec

    by = {r["metric"]: r for r in recs}
    c0 = 2 * get_spec("smollm2-135m").params() * 1000
    assert by["roi_rps_per_gpu_base"]["value"] == pytest.approx(1e12 * 0.4 / c0)
