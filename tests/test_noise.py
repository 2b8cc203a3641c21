"""Run-to-run noise calibration (kvbench.noise) and compare's use of it (issue 11.17)."""

import json
import math
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.compare import compare_sets, regressed
from kvbench.errors import KvbenchError
from kvbench.noise import load_calibration, spreads, t_quantile, t_within
from kvbench.schema import measured
from kvbench.store import ResultSet, load

CPU2 = {"cpu": {"logical_cpus": 2, "arch": "x86_64"}}
CPU8 = {"cpu": {"logical_cpus": 8, "arch": "x86_64"}}


def runs(medians: list[float], env: str = "e1", metric: str = "bandwidth",
         envs: dict | None = None) -> ResultSet:
    """One record (run) per median, 9 tight samples each: a machine drifting between runs."""
    recs = [{**measured("probe", "bandwidth", metric, "GB/s", "higher",
                        [m * (1 + 0.002 * (i - 4)) for i in range(9)],
                        {"size": 1 << 20}).to_dict(), "env_id": env} for m in medians]
    return ResultSet(Path("x"), envs=envs or {env: CPU2}, records=recs)


@pytest.mark.parametrize(("level", "df", "table"), [
    (0.95, 1, 12.706), (0.95, 2, 4.303), (0.95, 9, 2.262), (0.99, 5, 4.032),
    (0.999, 10, 4.587), (0.999, 30, 3.646)])
def test_t_quantile_matches_tables(level: float, df: int, table: float) -> None:
    """Two-sided Student t critical values as printed in standard tables."""
    assert t_quantile(level, df) == pytest.approx(table, abs=1e-3)
    assert t_within(t_quantile(level, df), df) == pytest.approx(level, abs=1e-9)


def test_spread_is_sd_of_log_run_medians() -> None:
    cal = runs([100.0, 110.0, 90.0, 105.0, 95.0])
    (s,) = spreads(cal).values()
    logs = [math.log(x) for x in (100.0, 110.0, 90.0, 105.0, 95.0)]
    mean = sum(logs) / 5
    assert s.runs == 5
    assert s.sd_log == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in logs) / 4))
    # two runs are too few to estimate a spread
    assert spreads(runs([100.0, 110.0])) == {}
    # the bound shrinks with runs per side
    assert s.bound(4, 4, 0.05) == pytest.approx(s.bound(1, 1, 0.05) / 2)


def test_single_runs_are_judged_against_calibrated_noise() -> None:
    """Drift between runs (run medians spread ~8%): one run a side of 100 -> 90 is a
    significant 10% regression by its tight samples alone, and noise against the calibrated
    spread; a halving is beyond both and regresses."""
    cal = spreads(runs([100.0, 110.0, 90.0, 105.0, 95.0, 102.0, 88.0, 108.0]))
    (row,) = compare_sets(runs([100.0]), runs([90.0]))
    assert row.verdict == "regressed" and row.noise is None
    (row,) = compare_sets(runs([100.0]), runs([90.0]), noise=cal)
    assert row.test == "mann-whitney + run noise" and row.verdict == "noise", row
    assert row.noise is not None and 0.1 < row.noise < 1.0
    (row,) = compare_sets(runs([100.0]), runs([50.0]), noise=cal)
    assert row.verdict == "regressed", row
    (row,) = compare_sets(runs([100.0]), runs([200.0]), noise=cal)
    assert row.verdict == "improved", row


def test_single_values_become_testable() -> None:
    """A derived single value (one sample per run) is untestable without a calibration and
    judged by the calibrated noise with one."""
    def one(values: list[float]) -> ResultSet:
        recs = [{**measured("probe", "bandwidth", "peak", "GB/s", "higher", [v],
                            {}).to_dict(), "env_id": "e1"} for v in values]
        return ResultSet(Path("x"), envs={"e1": CPU2}, records=recs)

    cal = spreads(one([10.0, 10.5, 9.6, 10.2, 9.9]))
    (row,) = compare_sets(one([10.0]), one([5.0]))
    assert (row.test, row.verdict) == ("untestable", "noise")
    (row,) = compare_sets(one([10.0]), one([5.0]), noise=cal)
    assert (row.test, row.verdict) == ("run noise", "regressed")
    (row,) = compare_sets(one([10.0]), one([9.4]), noise=cal)
    assert (row.test, row.verdict) == ("run noise", "noise")


def test_bonferroni_over_calibrated_quantities() -> None:
    """The level is shared among the quantities judged: the same pair judged among many
    calibrated quantities needs a larger change."""
    meds = [100.0, 110.0, 90.0, 105.0, 95.0]
    (few,) = compare_sets(runs([100.0]), runs([80.0]), noise=spreads(runs(meds)))
    metrics = [f"m{i}" for i in range(50)]

    def many(values: list[float]) -> ResultSet:
        out = ResultSet(Path("x"), envs={"e1": CPU2})
        for m in metrics:
            out.records.extend(runs(values, metric=m).records)
        return out

    rows = compare_sets(many([100.0]), many([80.0]), noise=spreads(many(meds)))
    assert few.noise is not None and rows[0].noise is not None
    assert rows[0].noise > few.noise


def test_calibration_must_match_the_machine_class() -> None:
    cal = runs([100.0, 110.0, 90.0])
    assert load_calibration([cal], [runs([100.0]), runs([90.0])])
    with pytest.raises(KvbenchError, match="is from cpu-8c-x86_64, the compared files from "
                                           "cpu-2c-x86_64"):
        load_calibration([runs([100.0, 110.0, 90.0], envs={"e1": CPU8})], [runs([100.0])])
    with pytest.raises(KvbenchError, match="one machine class"):
        load_calibration([cal], [runs([100.0]), runs([90.0], envs={"e1": CPU8})])
    with pytest.raises(KvbenchError, match="no quantity with 3 or more runs"):
        load_calibration([runs([100.0, 110.0])], [runs([100.0])])


BANDWIDTH = ["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "1M,16M",
             "--no-bars"]


def scaled(src: Path, dst: Path, factor: float) -> Path:
    """A copy of result file src with every GB/s value and sample multiplied by factor."""
    lines = [json.loads(x) for x in src.read_text().splitlines()]
    for rec in lines:
        if rec.get("unit") == "GB/s" and rec.get("value") is not None:
            rec["value"] *= factor
            rec["samples"] = [s * factor for s in rec["samples"]]
    dst.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return dst


@pytest.mark.bench
def test_real_runs_with_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real runs: six unchanged runs appended to one file calibrate; a seventh and eighth
    compare clean against each other with it; the eighth with its GB/s halved regresses in
    exactly the quantities whose calibrated noise is below a halving (none on a machine
    whose runs spread more than that), and with its GB/s divided by ten it exits 1."""
    cal, a, b = tmp_path / "cal.jsonl", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in [cal] * 6 + [a, b]:
        with pytest.raises(SystemExit) as e:
            main([*BANDWIDTH, "--out", str(out)])
        assert e.value.code == 0, capsys.readouterr().err
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["compare", str(a), str(b), "--noise", str(cal), "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert e.value.code == 0, [r for r in out["rows"] if r["verdict"] == "regressed"]
    assert any(r["noise"] is not None for r in out["rows"])
    halved = scaled(b, tmp_path / "halved.jsonl", 0.5)
    rows = compare_sets(load(b), load(halved), noise=spreads(load(cal)))
    catchable = {(r.metric, str(r.params)) for r in rows if r.unit == "GB/s" and r.noise is not None
                 and r.noise < 1.0}
    assert {(r.metric, str(r.params)) for r in regressed(rows)} == catchable
    with pytest.raises(SystemExit) as e:
        main(["compare", str(b), str(halved), "--noise", str(cal)])
    assert e.value.code == (1 if catchable else 0)
    with pytest.raises(SystemExit) as e:
        main(["compare", str(b), str(scaled(b, tmp_path / "tenth.jsonl", 0.1)), "--noise",
              str(cal)])
    assert e.value.code == 1


def test_bad_calibration_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = tmp_path / "a.jsonl"
    with pytest.raises(SystemExit) as e:
        main([*BANDWIDTH, "--out", str(a)])
    assert e.value.code == 0
    assert_usage_error(cli(["compare", str(a), str(a), "--noise", str(a)], capsys),
                       "no quantity with 3 or more runs")


def passes(levels: list[float], metric: str = "time") -> dict:
    """One run timed in passes: 9 tight samples at each pass's level (a drifting machine),
    the samples' passes in method.blocks as kvbench.timing.Timing.join records them."""
    samples = [v * (1 + 0.002 * (i - 4)) for v in levels for i in range(9)]
    return {**measured("probe", "attention", metric, "s", "lower", samples, {},
                       {"blocks": [9] * len(levels)}).to_dict(), "env_id": "e1"}


def test_passes_are_the_units() -> None:
    """A run timed in passes that drift by +-8%: one run a side 8% apart is a significant
    regression by its pooled samples, noise by its pass medians; a doubling is beyond the
    passes' spread and regresses."""
    base = [100.0, 108.0, 93.0, 104.0, 96.0, 110.0, 91.0, 102.0]

    def one(levels: list[float], blocks: bool = True) -> ResultSet:
        rec = passes(levels)
        if not blocks:
            rec["method"] = {}
        return ResultSet(Path("x"), envs={"e1": CPU2}, records=[rec])

    slower = [v * 1.08 for v in base]
    (row,) = compare_sets(one(base, False), one(slower, False))
    assert (row.test, row.verdict) == ("mann-whitney", "regressed"), row
    (row,) = compare_sets(one(base), one(slower))
    assert (row.test, row.verdict) == ("mann-whitney passes", "noise"), row
    (row,) = compare_sets(one(base), one([v * 2 for v in base]))
    assert (row.test, row.verdict) == ("mann-whitney passes", "regressed"), row
    # an inconsistent blocks list (not summing to the samples) is not trusted
    bad = one(base)
    bad.records[0]["method"]["blocks"] = [9, 9]
    (row,) = compare_sets(bad, one(slower, False))
    assert row.test == "mann-whitney", row


def test_alpha_is_the_comparisons_level() -> None:
    """Benjamini-Hochberg over the rows tested: a change with p = 0.003 regresses when it
    is the only quantity, not among 40 (alpha / 40 = 0.00125), while a halving
    (p = 1.6e-4) still does."""
    base = [100.0, 104.0, 97.0, 102.0, 99.0, 106.0, 95.0, 101.0]
    mild = [89.0, 92.0, 87.0, 94.0, 90.0, 86.0, 93.0, 88.0]

    def rec(metric: str, samples: list[float]) -> dict:
        return {**measured("probe", "p", metric, "GB/s", "higher", samples, {}).to_dict(),
                "env_id": "e1"}

    def files(new: dict[str, list[float]], others: int) -> tuple[ResultSet, ResultSet]:
        names = [*new, *(f"same{i}" for i in range(others))]
        return (ResultSet(Path("b"), envs={"e1": CPU2},
                          records=[rec(m, base) for m in names]),
                ResultSet(Path("n"), envs={"e1": CPU2},
                          records=[rec(m, new.get(m, base)) for m in names]))

    (row,) = compare_sets(*files({"mild": mild}, 0))
    assert 0.05 / 40 < row.p_value < 0.05 and row.verdict == "regressed", row
    rows = compare_sets(*files({"mild": mild, "half": [v / 2 for v in base]}, 38))
    by = {r.metric: r for r in rows}
    assert by["mild"].verdict == "noise" and "Benjamini-Hochberg" in by["mild"].marks[-1]
    assert by["half"].verdict == "regressed" and by["half"].p_value < 0.05 / 40
    assert [r.metric for r in regressed(rows)] == ["half"]


def test_bound_is_t_quantile_times_sd_times_sqrt_of_run_counts() -> None:
    """Issue 30: the bound's absolute value, with the t quantiles of a table (df = runs - 1
    = 4: t = 2.7764451052 for P(|T| <= t) = 0.95, 4.6040948713 for 0.99)."""
    meds = [100.0, 110.0, 90.0, 105.0, 95.0]
    logs = [math.log(x) for x in meds]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)
    (s,) = spreads(runs(meds)).values()
    assert s.bound(1, 1, 0.05) == pytest.approx(2.7764451052 * sd * math.sqrt(2), rel=1e-9)
    assert s.bound(4, 2, 0.01) == pytest.approx(4.6040948713 * sd * math.sqrt(0.75), rel=1e-9)
    # compare at one calibrated quantity (level 0.05): the row's noise is expm1(bound), and
    # a change of the log just inside the bound is noise, just beyond it regresses
    bound = 2.7764451052 * sd * math.sqrt(2)
    for factor, verdict in ((0.99, "noise"), (1.01, "regressed")):
        new = 100.0 * math.exp(-factor * bound)
        (row,) = compare_sets(runs([100.0]), runs([new]), noise=spreads(runs(meds)))
        assert row.noise == pytest.approx(math.expm1(bound), rel=1e-9)
        assert (row.test, row.verdict) == ("mann-whitney + run noise", verdict), row


# --- Student t in closed form, the spreads' filters, the messages (issue 30) ---

def _closed_form(t: float, df: int) -> float:
    """P(|T| <= t) written out per df (Abramowitz and Stegun 26.7.3-4 expanded by hand)."""
    th = math.atan(t / math.sqrt(df))
    s, c = math.sin(th), math.cos(th)
    return {1: 2 / math.pi * th,
            2: s,
            3: 2 / math.pi * (th + s * c),
            4: s * (1 + c**2 / 2),
            5: 2 / math.pi * (th + s * c * (1 + 2 / 3 * c**2)),
            6: s * (1 + c**2 / 2 + 3 / 8 * c**4),
            7: 2 / math.pi * (th + s * c * (1 + 2 / 3 * c**2 + 8 / 15 * c**4))}[df]


@pytest.mark.parametrize("df", range(1, 8))
@pytest.mark.parametrize("t", [0.3, 1.0, 2.5])
def test_t_within_closed_forms(t: float, df: int) -> None:
    assert t_within(t, df) == pytest.approx(_closed_form(t, df), rel=1e-12)
    assert t_within(t, 2) == pytest.approx(t / math.sqrt(2 + t * t), rel=1e-12)


def test_t_quantile_to_a_billionth() -> None:
    # df 1: t = tan(pi level / 2); df 2: t = level sqrt(2 / (1 - level^2))
    assert t_quantile(0.9, 1) == pytest.approx(math.tan(0.45 * math.pi), rel=2e-9)
    assert t_quantile(0.5, 2) == pytest.approx(0.5 * math.sqrt(2 / 0.75), rel=2e-9)
    assert t_quantile(0.3, 3) < 1.0  # below the first bracket [0, 1]


def test_spreads_skip_what_is_not_a_measured_positive_run() -> None:
    base = runs([100.0, 110.0, 90.0]).records
    skipped = [{**base[0], "status": "waived"}, {**base[0], "value": None},
               {**base[0], "direction": "none"}, {**base[0], "samples": [0.0, -1.0, 0.0]}]
    cal = ResultSet(Path("x"), envs={"e1": CPU2}, records=base[:2] + skipped)
    assert spreads(cal) == {}  # two runs left: below MIN_RUNS
    three = ResultSet(Path("x"), envs={"e1": CPU2}, records=base + skipped)
    (s,) = spreads(three).values()
    assert s.runs == 3
    assert s.sd_log == pytest.approx(
        math.sqrt(sum((math.log(x) - sum(map(math.log, (100, 110, 90))) / 3) ** 2
                      for x in (100.0, 110.0, 90.0)) / 2), rel=1e-12)
    value_only = [{**r, "samples": []} for r in base]  # no samples: the value is the run
    assert spreads(ResultSet(Path("x"), envs={"e1": CPU2}, records=value_only))


def test_calibration_messages_in_full() -> None:
    with pytest.raises(KvbenchError) as e:
        load_calibration([runs([1.0, 2.0, 3.0])], [ResultSet(Path("y"), envs={}, records=[])])
    assert str(e.value) == ("a noise calibration is for runs of one machine class; the "
                            "compared files hold none")
    with pytest.raises(KvbenchError) as e:
        load_calibration([runs([1.0, 2.0, 3.0])], [runs([1.0]), runs([1.0], envs={"e1": CPU8})])
    assert str(e.value).endswith("hold cpu-2c-x86_64, cpu-8c-x86_64")
    unused = runs([1.0, 2.0, 3.0], env="e2", envs={"e1": CPU2, "e2": CPU2})
    unused.records = [{**r, "env_id": "e9"} for r in unused.records]
    with pytest.raises(KvbenchError) as e:
        load_calibration([unused], [runs([1.0])])
    assert str(e.value) == ("noise calibration 'x' is from no machine, the compared files from "
                            "cpu-2c-x86_64")
    with pytest.raises(KvbenchError) as e:
        load_calibration([runs([1.0, 2.0])], [runs([1.0])])
    assert str(e.value) == ("noise calibration 'x' has no quantity with 3 or more runs "
                            "(append unchanged runs to it)")
    two = load_calibration([runs([1.0, 2.0, 3.0]), runs([1.0, 2.0, 4.0], metric="latency")],
                           [runs([1.0])])
    assert len(two) == 2  # the spreads of every calibration file


def test_t_quantile_below_one_to_a_billionth() -> None:
    # small quantiles: the bisection's tolerance is relative to t (1e-9 t), not 1e-9 / t
    assert t_quantile(0.1, 1) == pytest.approx(math.tan(0.05 * math.pi), rel=2e-9)
    assert t_quantile(0.05, 2) == pytest.approx(0.05 * math.sqrt(2 / (1 - 0.05**2)), rel=2e-9)


def test_spreads_read_past_a_skipped_record_and_name_every_class() -> None:
    base = runs([100.0, 110.0, 90.0]).records
    cal = ResultSet(Path("x"), envs={"e1": CPU2}, records=[{**base[0], "status": "error"},
                                                          *base])
    (s,) = spreads(cal).values()
    assert s.runs == 3
    two = runs([1.0, 2.0, 3.0], envs={"e1": CPU2, "e2": CPU8})
    two.records.append({**two.records[0], "env_id": "e2"})
    with pytest.raises(KvbenchError) as e:
        load_calibration([two], [runs([1.0])])
    assert str(e.value) == ("noise calibration 'x' is from cpu-2c-x86_64, cpu-8c-x86_64, the "
                            "compared files from cpu-2c-x86_64")
