"""`kvbench serve-sim`: the batch-time fit, the SLO-bounded batching scheduler on Poisson
arrivals, the end-to-end command, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli, needs_bundled

from kvbench.cli import main
from kvbench.prefix.serve import fit, goodput, simulate


def test_fit_recovers_a_line() -> None:
    a, b = fit([1, 2, 4, 8], [0.5 + 0.25 * n for n in (1, 2, 4, 8)])
    assert a == pytest.approx(0.5) and b == pytest.approx(0.25)
    assert fit([4], [2.0]) == (0.0, 0.5)


def test_light_load_serves_alone_within_slo() -> None:
    """Arrivals 1000x slower than a batch: every request waits for nothing, runs alone,
    its TTFT is the one-request time a + b."""
    cost = {"initial": (0.02, 0.01), "follow": (0.02, 0.01)}
    s = simulate(0.03, 200, 1.0, 0.4, cost, 8, seed=1)
    assert s["mean_batch"] == 1.0 and s["attainment"] == 1.0
    assert s["ttft_p50"] == pytest.approx(0.03) and s["ttft_p99"] == pytest.approx(0.03)


def test_heavy_load_batches_up_to_the_slo() -> None:
    """A flood of requests (0.1 s each, SLO 0.35 s): a batch admits at most 3 (the third
    brings its first member to 0.3 s plus its wait), and never more than max_batch."""
    cost = {"initial": (0.0, 0.1), "follow": (0.0, 0.1)}
    s = simulate(1000.0, 300, 1.0, 0.35, cost, 8, seed=2)
    assert 1.0 < s["mean_batch"] <= 3.0 and s["attainment"] < 0.5
    assert simulate(1000.0, 300, 1.0, 100.0, cost, 4, seed=2)["mean_batch"] <= 4.0


def test_cheaper_follow_ups_raise_goodput_only_with_h() -> None:
    rc = (0.05, 0.1)
    cheap = {"initial": rc, "follow": (0.05, 0.02)}
    rates = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]

    def gp(cost, h):
        return goodput({r: simulate(r, 500, h, 0.4, cost, 16, seed=3) for r in rates})

    base = gp({"initial": rc, "follow": rc}, 1.0)
    assert gp(cheap, 1.0) > base and gp(cheap, 0.0) == base


@pytest.mark.parametrize("args, msg", [
    (["--slo", "0"], "the TTFT SLO must be above 0 s"),
    (["--batches", "x"], "--batches 'x'"),
    (["--tiers", "host:9"], "NUMA node 9 does not exist"),
    (["--context", "16", "--new-ratio", "0.5"], "leaves no whole chunk"),
])
def test_cli_bad_input_exit_2(args, msg, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(cli(["serve-sim", *args], capsys), msg)


@needs_bundled
def test_cli_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["serve-sim", "--context", "40", "--new-ratio", "0.2", "--batches", "1,2",
              "--reps", "1", "--requests", "50", "--rates", "0.5,1", "--tiers",
              f"accel,disk:{tmp_path / 'c'}", "--threads", "1", "--out", str(out)])
    assert e.value.code == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()][1:]
    ttft = {(r["params"]["path"], r["params"]["batch"]) for r in recs
            if r["metric"] == "serve_ttft"}
    assert ttft == {(p, b) for p in ("recompute", "accel", f"disk:{tmp_path / 'c'}", "resident")
                    for b in (1, 2)}
    assert all(r["provenance"] == "projected" for r in recs if r["metric"].startswith("sim_"))
    assert all(r["provenance"] == "measured" for r in recs if r["metric"].startswith("serve_"))
    assert {r["params"]["prefix"] for r in recs if r["metric"] == "serve_ttft"} == {32}
