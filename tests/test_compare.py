import itertools
import json
import math
import random
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.compare import (
    common_shift,
    compare_sets,
    mann_whitney_p,
    min_p_value,
    regressed,
    select_env,
)
from kvbench.errors import KvbenchError
from kvbench.schema import measured, not_measured
from kvbench.store import ResultSet, ResultWriter, load

ENV = {"env_id": "e1"}


def brute_force_p(x: list[float], y: list[float]) -> float:
    """Two-sided exact p by enumerating every split of the pooled values."""
    pooled = x + y

    def u_of(a: list[float], b: list[float]) -> float:
        return sum((ai > bi) + 0.5 * (ai == bi) for ai in a for bi in b)

    u = u_of(x, y)
    us = []
    for idx in itertools.combinations(range(len(pooled)), len(x)):
        a = [pooled[i] for i in idx]
        b = [pooled[i] for i in range(len(pooled)) if i not in idx]
        us.append(u_of(a, b))
    lo = sum(v <= u for v in us) / len(us)
    hi = sum(v >= u for v in us) / len(us)
    return min(1.0, 2 * min(lo, hi))


@pytest.mark.parametrize("seed", range(6))
def test_exact_mann_whitney_matches_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    n1, n2 = rng.randint(2, 6), rng.randint(2, 6)
    x = [rng.random() for _ in range(n1)]
    y = [rng.random() + rng.choice([0, 0.5]) for _ in range(n2)]
    assert mann_whitney_p(x, y) == pytest.approx(brute_force_p(x, y))


def test_mann_whitney_extremes() -> None:
    assert mann_whitney_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    assert min_p_value(3, 3) == pytest.approx(0.1)
    # with ties the normal approximation is used: identical samples are indistinguishable
    assert mann_whitney_p([1.0] * 20, [1.0] * 20) == 1.0
    assert mann_whitney_p([1.0, 1.0, 2.0] * 10, [5.0, 5.0, 6.0] * 10) < 1e-6


def write(path: Path, recs: list) -> Path:
    with ResultWriter(path, ENV) as w:
        w.write_all(recs)
    return path


def noisy(rng: random.Random, centre: float, n: int = 15) -> list[float]:
    return [centre * rng.lognormvariate(0, 0.03) for _ in range(n)]


def run_files(tmp_path: Path, bw_scale: float, lat_scale: float, seed: int) -> Path:
    rng = random.Random(seed)
    return write(tmp_path / f"r{seed}-{bw_scale}-{lat_scale}.jsonl", [
        measured("probe", "bw", "bandwidth", "GB/s", "higher", noisy(rng, 10 * bw_scale),
                 {"size": 1 << 20}),
        measured("probe", "bw", "latency", "us", "lower", noisy(rng, 5 * lat_scale),
                 {"size": 1 << 20}),
        measured("run", "full", "perplexity", "", "lower", [12.5 * lat_scale], {},
                 {"exact": "deterministic"}),
        measured("probe", "bw", "latency_floor", "us", "lower", [2.0 * lat_scale], {},
                 {"derived": "min over sizes"}),
    ])


def test_same_distribution_compares_clean(tmp_path: Path) -> None:
    for seed in range(10):
        rows = compare_sets(load(run_files(tmp_path, 1, 1, seed)),
                            load(run_files(tmp_path, 1, 1, seed + 100)))
        assert not regressed(rows)
        assert {r.verdict for r in rows} <= {"same", "noise"}


def test_direction_aware(tmp_path: Path) -> None:
    base = load(run_files(tmp_path, 1, 1, 0))
    worse = {r.metric: r for r in compare_sets(base, load(run_files(tmp_path, 0.5, 2, 1)))}
    assert worse["bandwidth"].verdict == "regressed" and worse["bandwidth"].change < -0.4
    assert worse["latency"].verdict == "regressed"
    assert worse["perplexity"].verdict == "regressed" and worse["perplexity"].test == (
        "threshold-only")
    # one derived value, uncertainty unknown: shown, never a verdict (issue 11.17)
    assert worse["latency_floor"].verdict == "noise" and worse["latency_floor"].test == (
        "untestable")
    assert worse["latency_floor"] not in regressed(list(worse.values()))
    better = {r.metric: r for r in compare_sets(base, load(run_files(tmp_path, 2, 0.5, 2)))}
    assert {r.verdict for r in better.values()} == {"improved", "noise"}
    # a suite guard vouches for its threshold: the single value is judged by it
    guarded = compare_sets(base, load(run_files(tmp_path, 0.5, 2, 1)), pattern="latency_floor",
                           thresholded=True)
    assert [(r.verdict, r.test) for r in guarded] == [("regressed", "threshold-only")]


def test_beyond_threshold_but_not_significant_is_noise(tmp_path: Path) -> None:
    base = write(tmp_path / "a.jsonl", [measured("probe", "p", "m", "s", "lower",
                                                 [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])])
    new = write(tmp_path / "b.jsonl", [measured("probe", "p", "m", "s", "lower",
                                                [1.5, 2.5, 3.5, 4.5, 5.5, 6.5])])
    (row,) = compare_sets(load(base), load(new))
    assert row.change < -0.05 and row.p_value > 0.05 and row.verdict == "noise"


def test_error_missing_added_and_marks(tmp_path: Path) -> None:
    base = write(tmp_path / "a.jsonl", [
        measured("probe", "p", "m1", "s", "lower", [1.0] * 3),
        measured("probe", "p", "gone", "s", "lower", [1.0] * 3),
        measured("probe", "p", "gpu", "s", "lower", [1.0] * 3),
    ])
    with ResultWriter(tmp_path / "b.jsonl", {"env_id": "e2"}) as w:
        w.write(not_measured("probe", "p", "m1", "error", "segfault"))
        w.write(not_measured("probe", "p", "gpu", "waived", "no GPU"))
        w.write(measured("probe", "p", "fresh", "s", "lower", [1.0]))
    rows = {r.metric: r for r in compare_sets(load(base), load(tmp_path / "b.jsonl"))}
    assert rows["m1"].verdict == "error" and "env differs" in rows["m1"].marks
    assert rows["gone"].verdict == "missing"
    assert rows["gpu"].verdict == "unmeasured"
    assert rows["fresh"].verdict == "added"
    assert [r.metric for r in regressed(list(rows.values()))] == ["m1"]


def test_metric_glob(tmp_path: Path) -> None:
    rows = compare_sets(load(run_files(tmp_path, 1, 1, 0)), load(run_files(tmp_path, 0.5, 1, 1)),
                        pattern="lat*")
    assert [r.metric for r in rows] == ["latency", "latency_floor"]


def test_metric_glob_matching_nothing_is_an_error(tmp_path: Path, capsys) -> None:
    """An empty selection compares nothing: it used to print '0 quantities' and pass."""
    base, new = run_files(tmp_path, 1, 1, 0), run_files(tmp_path, 0.5, 1, 1)
    line = assert_usage_error(cli(["compare", str(base), str(new), "--metric", "lat*",
                                   "--metric", "nomatch*"], capsys), str(base), str(new))
    assert line.startswith("kvbench: error: --metric 'nomatch*' matches no quantity of ")


def halve_gbps(src: Path, dst: Path) -> None:
    """dst: src with every GB/s value and sample halved."""
    lines = [json.loads(x) for x in src.read_text().splitlines()]
    for rec in lines:
        if rec["kind"] == "probe" and rec["value"] is not None and rec["unit"] == "GB/s":
            rec["samples"] = [s / 2 for s in rec["samples"]]
            rec["value"] /= 2
    dst.write_text("".join(json.dumps(x) + "\n" for x in lines))


REAL_RUNS = {  # small versions of each probe's default run (CI: 2 cores)
    "bandwidth": ["probe", "bandwidth", "--src", "host:0", "--dst", "host:0",
                  "--sizes", "1M,16M", "--no-bars"],
    "attention": ["probe", "attention", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                  "--gpu-tokens", "64", "--host-tokens", "128", "--query", "1",
                  "--dtype", "fp32", "--min-time", "0"],
}


@pytest.mark.bench
@pytest.mark.parametrize("probe", sorted(REAL_RUNS))
def test_real_runs_twice_never_judge_diagnostics(tmp_path: Path, probe: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11.17: two unchanged runs at the default threshold. Diagnostics of spread
    (CV) are informational and single derived values (peak, n1/2, latency floor, a ratio
    of medians) untestable: whatever the machine's noise, none of them can regress; the
    attention probe's per-point bars are per-pass ratios and tested; the same file with
    its GB/s halved still regresses (exit 1)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (a, b):
        with pytest.raises(SystemExit) as e:
            main([*REAL_RUNS[probe], "--out", str(out)])
        assert e.value.code == 0, capsys.readouterr().err
    rows = compare_sets(load(a), load(b))
    one = {x["metric"] for x in load(a).records if x["status"] == "ok" and len(x["samples"]) == 1}
    single = [r for r in rows if r.base is not None and r.direction != "none" and r.metric in one]
    if probe == "attention":  # its per-point bars are per-pass ratios: tested, not single
        bars = [r for r in rows if r.metric in ("bar.merge_share_of_hybrid",
                                                "bar.cpu_sparse_over_dense_gbps")]
        assert bars and all(r.test.startswith("mann-whitney") for r in bars), bars
    else:
        assert single  # the bandwidth probe derives single values (peak, n1/2, floor)
    for r in rows:
        if r.direction == "none" and r.base is not None:
            assert (r.test, r.verdict) == ("informational", "same"), r
    for r in single:
        assert r.test == "untestable" and r.verdict in ("same", "noise"), r
    if probe != "bandwidth":
        return
    assert {r.metric: r.test for r in rows}["cv_median_ge_1m"] == "informational"
    halved = tmp_path / "halved.jsonl"
    halve_gbps(a, halved)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["compare", str(a), str(halved), "--format", "json"])
    assert e.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert {(r["metric"], r["params"]["size"]) for r in out["rows"]
            if r["verdict"] == "regressed"} == {("bandwidth", 1 << 20), ("bandwidth", 16 << 20)}
    # doubled is an improvement, not a regression: exit 0
    with pytest.raises(SystemExit) as e:
        main(["compare", str(halved), str(a), "--format", "markdown"])
    assert e.value.code == 0
    assert "| improved |" in capsys.readouterr().out


def test_attention_backend_change_is_marked() -> None:
    """A run whose attention fell back to torch is compared, and visibly marked."""

    def rs(backend: str) -> ResultSet:
        rec = {"kind": "run", "name": "full", "metric": "tbt", "provenance": "measured",
               "params": {}, "unit": "s", "direction": "lower", "status": "ok", "value": 1.0,
               "samples": [1.0], "env_id": "e", "method": {"backend": {"decode": backend}}}
        return ResultSet(Path("x"), records=[rec])

    assert compare_sets(rs("native"), rs("native"))[0].marks == []
    assert compare_sets(rs("native"), rs("torch"))[0].marks == ["attention backend differs"]


def test_two_machines_of_one_fleet_file(tmp_path, capsys):
    """A fleet file: compare picks each machine's records by name or class, the report puts
    their headline figures side by side (no Ray needed: the envs are written by hand)."""
    from kvbench.envinfo import collect_env
    from kvbench.summary import by_machine

    path = tmp_path / "fleet.jsonl"
    peak = {"src": "host:0", "dst": "host:0", "memory": "pageable", "threads": 1}
    base = collect_env()
    for name, cls, gbps in [("n1", "a100", 10.0), ("n2", "h100", 20.0)]:
        env = {**base, "env_id": f"id-{name}", "node": {"name": name, "class": cls}}
        with ResultWriter(path, env) as w:
            w.write(measured("probe", "bandwidth", "peak_bandwidth", "GB/s", "higher",
                             [gbps * (1 + 0.01 * i) for i in range(9)], peak))
    rs = load(path)
    rows = compare_sets(select_env(rs, "a100"), select_env(rs, "n2"), 0.05, 0.05)
    assert len(rows) == 1 and rows[0].verdict == "improved" and "env differs" in rows[0].marks
    table = by_machine(rs.envs, rs.records)
    assert table[0] == ["headline", "a100 (n1)", "h100 (n2)"]
    assert table[1][1:] == ["10.4 GB/s", "20.8 GB/s"]  # medians of each machine's samples
    with pytest.raises(SystemExit) as e:
        main(["compare", str(path), "--base-env", "a100", "--new-env", "h100"])
    assert e.value.code == 0
    assert "improved" in capsys.readouterr().out
    with pytest.raises(KvbenchError, match=r"no environment 'tpu'.*id-n1 = a100 \(n1\)"):
        select_env(rs, "tpu")


def runs_of(medians: list[float], spread: float = 0.002) -> ResultSet:
    """One record (run) per median, each with 9 tight samples around it: a machine whose
    speed drifts between runs far more than within one."""
    recs = []
    for m in medians:
        rec = measured("probe", "bandwidth", "bandwidth", "GB/s", "higher",
                       [m * (1 + spread * (i - 4)) for i in range(9)], {"size": 1 << 20})
        recs.append({**rec.to_dict(), "env_id": "e1"})
    return ResultSet(Path("x"), records=recs)


def test_runs_are_judged_against_their_spread() -> None:
    """Four runs a side: the test runs on run medians. Drift between runs (run medians
    spread 10%) with an 8% lower median is noise, where one run a side of the same values
    regresses; a shift beyond the runs' spread regresses."""
    base, drifted = [100.0, 110.0, 90.0, 105.0], [92.0, 101.0, 88.0, 96.0]
    (row,) = compare_sets(runs_of(base), runs_of(drifted))
    assert row.test == "mann-whitney runs" and row.verdict == "noise", row
    assert row.change is not None and row.change < -0.05
    # one run a side: its tight samples cannot see the drift, so 100 -> 92 regresses
    (row,) = compare_sets(runs_of(base[:1]), runs_of(drifted[:1]))
    assert row.test == "mann-whitney" and row.verdict == "regressed", row
    (row,) = compare_sets(runs_of(base), runs_of([70.0, 75.0, 68.0, 72.0]))
    assert row.test == "mann-whitney runs" and row.verdict == "regressed", row
    # three runs a side cannot reach alpha on run medians: pooled samples decide
    (row,) = compare_sets(runs_of(base[:3]), runs_of([70.0, 75.0, 68.0]))
    assert row.test == "mann-whitney" and row.verdict == "regressed", row


def sizes_file(path: Path, scale: dict[int, float], seed: int) -> Path:
    rng = random.Random(seed)
    return write(path, [measured("probe", "bw", "bandwidth", "GB/s", "higher",
                                 noisy(rng, 10 * scale.get(s, 1.0)), {"size": s})
                        for s in range(8)])


def test_a_shift_of_every_quantity_is_named(tmp_path: Path, capsys) -> None:
    """A whole run slower (a machine's state between runs, results/compare-noise) regresses
    as before, and the summary says that every quantity moved together; a change of a few
    quantities does not get that line."""
    base = sizes_file(tmp_path / "a.jsonl", {}, 0)
    slower = sizes_file(tmp_path / "b.jsonl", dict.fromkeys(range(8), 0.7), 1)
    rows = compare_sets(load(base), load(slower))
    shift = common_shift(rows, 0.05)
    assert regressed(rows) and shift is not None
    assert shift.judged == shift.moved == 8 and -0.35 < shift.median < -0.25

    def compare(*argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            main(["compare", *argv])
        assert e.value.code == 1
        return capsys.readouterr().out

    assert json.loads(compare(str(base), str(slower), "--format", "json")
                      )["common_shift"]["moved"] == 8
    assert "All together: 8 of 8 quantities moved the same way" in compare(
        str(base), str(slower), "--format", "markdown")
    two = sizes_file(tmp_path / "c.jsonl", {0: 0.7, 1: 0.7}, 2)
    rows = compare_sets(load(base), load(two))
    assert len(regressed(rows)) == 2 and common_shift(rows, 0.05) is None
    assert "All together" not in compare(str(base), str(two))


def single(value: float, direction: str, exact: bool = True) -> ResultSet:
    """One run of one quantity holding a single value; `exact` declares it deterministic."""
    rec = measured("run", "full", "q", "", direction, [value], {},
                   {"exact": "deterministic"} if exact else {})
    return ResultSet(Path("x"), records=[{**rec.to_dict(), "env_id": "e1"}])


@pytest.mark.parametrize(("direction", "new", "change", "verdict"), [
    # at the threshold (change exactly 0.05 = 5 / 100): within it
    ("higher", 105.0, 0.05, "same"), ("lower", 95.0, 0.05, "same"),
    ("higher", 95.0, -0.05, "same"), ("lower", 105.0, -0.05, "same"),
    # just inside
    ("higher", 104.9, 0.049, "same"), ("lower", 95.1, 0.049, "same"),
    ("higher", 95.1, -0.049, "same"), ("lower", 104.9, -0.049, "same"),
    # just beyond
    ("higher", 105.1, 0.051, "improved"), ("lower", 94.9, 0.051, "improved"),
    ("higher", 94.9, -0.051, "regressed"), ("lower", 105.1, -0.051, "regressed"),
])
@pytest.mark.parametrize("exact", [True, False])
def test_threshold_verdict_per_direction(direction: str, new: float, change: float,
                                         verdict: str, exact: bool) -> None:
    """Issue 30: a single value, base 100, threshold 0.05, judged by the threshold alone
    (declared exact, or vouched for by the caller). The change is signed + = better:
    (new - base) / base for higher-is-better, (base - new) / base for lower."""
    (row,) = compare_sets(single(100.0, direction, exact), single(new, direction, exact),
                          threshold=0.05, thresholded=not exact)
    assert (row.test, row.verdict) == ("threshold-only", verdict), row
    assert row.change == pytest.approx(change, abs=1e-12)
    assert (row.base, row.new, row.p_value) == (100.0, new, None)
    assert regressed([row]) == ([row] if verdict == "regressed" else [])


@pytest.mark.parametrize(("new", "verdict"), [(105.0, "same"), (105.1, "noise")])
def test_untestable_single_value_is_never_a_verdict(new: float, verdict: str) -> None:
    """Neither exact nor vouched for: beyond the threshold is shown as noise, at it same."""
    (row,) = compare_sets(single(100.0, "higher", False), single(new, "higher", False))
    assert (row.test, row.verdict) == ("untestable", verdict)


@pytest.mark.parametrize(("direction", "new", "change", "verdict"), [
    ("higher", 0.0, 0.0, "same"), ("lower", 0.0, 0.0, "same"),
    ("higher", 2.0, float("inf"), "improved"), ("lower", 2.0, float("-inf"), "regressed"),
    ("higher", -2.0, float("-inf"), "regressed"), ("lower", -2.0, float("inf"), "improved"),
])
@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_base_zero(direction: str, new: float, change: float, verdict: str,
                   threshold: float) -> None:
    """A base of 0: no relative change exists; equal values are the same even at a zero
    threshold, and any other new value is an infinite change in the sign its direction
    gives."""
    (row,) = compare_sets(single(0.0, direction), single(new, direction), threshold=threshold)
    assert row.change == change and (row.test, row.verdict) == ("threshold-only", verdict)


def test_equal_values_at_zero_threshold_are_the_same() -> None:
    """threshold 0: only a change strictly beyond it counts, so identical values stay
    'same' (not 'regressed' by a zero change)."""
    for direction in ("higher", "lower"):
        (row,) = compare_sets(single(7.0, direction), single(7.0, direction), threshold=0.0)
        assert (row.change, row.verdict) == (0.0, "same")
        (row,) = compare_sets(single(7.0, direction), single(7.5, direction), threshold=0.0)
        assert row.verdict == ("improved" if direction == "higher" else "regressed")


def tight(centre: float, direction: str, step: float = 0.005) -> ResultSet:
    rec = measured("probe", "p", "m", "s", direction,
                   [centre * (1 + step * (i - 4)) for i in range(9)])
    return ResultSet(Path("x"), records=[{**rec.to_dict(), "env_id": "e1"}])


@pytest.mark.parametrize("direction", ["higher", "lower"])
def test_shifted_base_test_decides(direction: str) -> None:
    """9 samples a side, spread +-2%: 100 -> 106 (change 6%, beyond 5%) is significant
    against the base (every new sample above every base one) but not against the base moved
    by the threshold (105 +- 2%): noise, its p the Mann-Whitney p of the moved samples. 100
    -> 112 is beyond both."""
    base = tight(100.0, direction)
    sb = [100.0 * (1 + 0.005 * (i - 4)) for i in range(9)]
    for new, verdict in ((106.0, "noise"), (112.0, "improved" if direction == "higher"
                                            else "regressed"),
                         (94.0, "noise"), (88.0, "regressed" if direction == "higher"
                                           else "improved")):
        sn = [new * (1 + 0.005 * (i - 4)) for i in range(9)]
        (row,) = compare_sets(base, tight(new, direction), threshold=0.05)
        moved = [x * (1.05 if new > 100 else 0.95) for x in sb]
        assert row.test == "mann-whitney" and row.p_value == mann_whitney_p(moved, sn)
        assert mann_whitney_p(sb, sn) == pytest.approx(2 / 48620)  # C(18, 9): disjoint
        sign = 1 if direction == "higher" else -1
        assert row.change == pytest.approx(sign * (new - 100.0) / 100.0, rel=1e-12)
        assert row.verdict == verdict, (new, row)
        assert (row.p_value < 0.05) == (verdict != "noise")


def test_each_metric_gets_its_own_verdict_in_one_comparison() -> None:
    """Several exact quantities of both directions in one pair of files, each judged by its
    own change against the 5% threshold (no Mann-Whitney p, so Benjamini-Hochberg leaves
    threshold-only rows alone), and a tested one beside them."""
    def recs(values: dict[str, tuple[str, float]], tested: float) -> ResultSet:
        out = [{**measured("run", "full", m, "", d, [x], {}, {"exact": "yes"}).to_dict(),
                "env_id": "e1"} for m, (d, x) in values.items()]
        out.append({**measured("probe", "bw", "bandwidth", "GB/s", "higher",
                               [tested * (1 + 0.001 * i) for i in range(9)]).to_dict(),
                    "env_id": "e1"})
        return ResultSet(Path("x"), records=out)

    base = recs({"ppl": ("lower", 10.0), "acc": ("higher", 0.5), "err": ("lower", 0.2),
                 "recall": ("higher", 0.8), "zero": ("lower", 0.0)}, 100.0)
    new = recs({"ppl": ("lower", 10.5), "acc": ("higher", 0.53), "err": ("lower", 0.1),
                "recall": ("higher", 0.7), "zero": ("lower", 0.0)}, 50.0)
    rows = {r.metric: r for r in compare_sets(base, new, threshold=0.05)}
    assert {m: (r.verdict, r.test) for m, r in rows.items()} == {
        "ppl": ("same", "threshold-only"),  # -5.0%: at the threshold
        "acc": ("improved", "threshold-only"),  # +6%
        "err": ("improved", "threshold-only"),  # -50% of a lower-is-better value
        "recall": ("regressed", "threshold-only"),  # -12.5%
        "zero": ("same", "threshold-only"),
        "bandwidth": ("regressed", "mann-whitney")}
    assert rows["ppl"].change == -0.05 and rows["err"].change == 0.5
    assert rows["recall"].change == pytest.approx(-0.125, abs=1e-15)
    assert [r.metric for r in regressed(list(rows.values()))] == ["recall", "bandwidth"]


# --- edges of the test, the shift and the environment selection (compare survivors) ---

def test_mann_whitney_small_and_tied_samples_by_hand() -> None:
    assert mann_whitney_p([], [1.0]) == 1.0 and mann_whitney_p([1.0], []) == 1.0
    # one value below three: U = 0, one split in four that extreme each side
    assert mann_whitney_p([0.0], [1.0, 2.0, 3.0]) == 0.5
    assert mann_whitney_p([1.0, 2.0, 3.0], [0.0]) == 0.5
    # ties: ranks 1.5 1.5 3.5 3.5 5.5 5.5, R1 = 6.5, U = 0.5, tie term 3 (2^3 - 2) = 18,
    # var = 9/12 (7 - 18/30) = 4.8, z = (|0.5 - 4.5| - 0.5) / sqrt(4.8)
    z = 3.5 / math.sqrt(4.8)
    assert mann_whitney_p([1.0, 1.0, 2.0], [2.0, 3.0, 3.0]) == pytest.approx(
        math.erfc(z / math.sqrt(2)), rel=1e-12)


def _rows(*changes: float | None) -> list:
    from kvbench.compare import Row

    return [Row("probe", "p", f"m{i}", "measured", {}, "", "higher", 1.0, 1.0, c, None, "",
                "same") for i, c in enumerate(changes)]


def test_common_shift_at_its_bounds() -> None:
    from kvbench.compare import Shift

    assert common_shift(_rows(0.1, 0.1, 0.1, 0.1), 0.05) is None  # four: too few
    assert common_shift(_rows(0.1, 0.1, 0.1, 0.1, 0.1, None, math.inf), 0.05) == Shift(
        5, 5, 0.1)  # five finite changes are enough; none and infinite ones are left out
    assert common_shift(_rows(0.1, 0.1, 0.1, 0.1, 0.0), 0.05) == Shift(5, 4, 0.1)  # 80%
    assert common_shift(_rows(0.1, 0.1, 0.1, -0.1, -0.1), 0.05) is None  # 60% moved
    assert common_shift(_rows(0.05, 0.05, 0.05, 0.05, 0.05), 0.05) is None  # at threshold
    assert common_shift(_rows(0.01, 0.01, 0.01, 0.01, 0.01), 0.05) is None  # within it
    assert common_shift(_rows(-0.1, -0.1, 0.0, 0.1, 0.1), 0.0) is None  # median 0


def test_select_env_by_id_host_name_and_class_only() -> None:
    envs = {"id-a": {"hostname": "box1", "cpu": {"logical_cpus": 2, "arch": "x86_64"}},
            "id-b": {"cpu": {"logical_cpus": 8, "arch": "x86_64"},
                     "node": {"name": "n2", "class": "big"}}}
    recs = [{"env_id": "id-a", "metric": "a"}, {"env_id": "id-b", "metric": "b"}]
    rs = ResultSet(Path("f.jsonl"), envs, recs, ["w"])
    for which, env in (("id-a", "id-a"), ("box1", "id-a"), ("cpu-2c-x86_64", "id-a"),
                       ("n2", "id-b"), ("big", "id-b"), ("id-b", "id-b")):
        got = select_env(rs, which)
        assert (got.path, list(got.envs), got.warnings) == (Path("f.jsonl"), [env], ["w"])
        assert got.records == [r for r in recs if r["env_id"] == env]
    for which in ("", "XXXX"):  # an empty or absent name matches no machine
        with pytest.raises(KvbenchError) as e:
            select_env(rs, which)
        assert str(e.value) == (f"no environment '{which}' in 'f.jsonl' (it holds: id-a = "
                                "cpu-2c-x86_64 (box1), id-b = big (n2))")


def test_min_p_value_small_sides() -> None:
    assert min_p_value(0, 3) == 1.0 and min_p_value(3, 0) == 1.0
    assert min_p_value(1, 3) == pytest.approx(0.5, rel=1e-12)  # 2 / C(4, 1)
    assert min_p_value(3, 1) == pytest.approx(0.5, rel=1e-12)
    assert min_p_value(1, 1) == pytest.approx(1.0, rel=1e-12)


def test_rows_carry_the_quantitys_identity_and_empty_tests() -> None:
    def rs(*recs: dict) -> ResultSet:
        return ResultSet(Path("x"), records=[{**r, "env_id": "e1"} for r in recs])

    a = measured("probe", "bw", "bandwidth", "GB/s", "higher", [1.0, 2.0], {"size": 4}).to_dict()
    a["provenance"] = "projected"
    b = measured("run", "full", "tbt", "s", "lower", [1.0]).to_dict()
    rows = compare_sets(rs(a, b), rs(a))
    same, missing = rows
    assert (same.kind, same.name, same.metric, same.provenance, same.params, same.unit,
            same.direction) == ("probe", "bw", "bandwidth", "projected", {"size": 4}, "GB/s",
                                "higher")
    assert (missing.kind, missing.name, missing.metric, missing.verdict, missing.test) == (
        "run", "full", "tbt", "missing", "")
    (added,) = compare_sets(rs(a), rs(a, b))[1:]
    assert (added.verdict, added.test, added.params) == ("added", "", {})


def test_samples_runs_and_units_of_measured_records_only() -> None:
    from kvbench.compare import _run_medians, _samples, _units

    only_value = {"status": "ok", "value": 2.0, "samples": []}
    waived_with_value = {"status": "waived", "value": 3.0, "samples": [3.0]}
    ok_without_value = {"status": "ok", "value": None, "samples": []}
    blocks = {"status": "ok", "value": 2.5, "samples": [1.0, 2.0, 3.0, 4.0],
              "method": {"blocks": [2, 2]}}
    recs = [only_value, waived_with_value, ok_without_value, blocks]
    assert _samples(recs) == [2.0, 1.0, 2.0, 3.0, 4.0]
    assert _run_medians(recs) == [2.0, 2.5]
    assert _units(recs) == [2.0, 1.5, 3.5]


def test_benjamini_hochberg_at_its_bounds() -> None:
    from kvbench.compare import Row, _fdr

    def row(p: float, verdict: str) -> Row:
        return Row("probe", "p", "m", "measured", {}, "", "higher", 1.0, 1.0, 0.1, p,
                   "mann-whitney", verdict)

    # m = 2 (a "same" row enters with p = 1): the first p passes at exactly 1 x 0.05 / 2
    kept = [row(0.025, "regressed"), row(0.01, "same")]
    _fdr(kept, 0.05)
    assert kept[0].verdict == "regressed" and kept[0].marks == []
    dropped = [row(0.04, "improved"), row(0.01, "same")]
    _fdr(dropped, 0.05)  # 0.04 > 0.025 and 1 > 0.05: nothing passes
    assert dropped[0].verdict == "noise"
    assert dropped[0].marks == ["not significant among 2 tested (Benjamini-Hochberg)"]


def test_bonferroni_counts_the_calibrated_quantities_both_files_hold() -> None:
    """Two calibrated quantities, only one in both files: its level is alpha / 1."""
    from kvbench.noise import Spread
    from kvbench.schema import record_key

    def rs(*metrics: str) -> ResultSet:
        return ResultSet(Path("x"), records=[
            {**measured("probe", "p", m, "s", "lower", [1.0]).to_dict(), "env_id": "e1"}
            for m in metrics])

    base = rs("a", "b")
    spread = Spread(0.1, 5)
    noise = {record_key(r): spread for r in base.records}
    (row, _) = compare_sets(base, rs("a"), noise=noise)
    assert row.noise == pytest.approx(math.expm1(spread.bound(1, 1, 0.05)), rel=1e-12)


def test_unmeasured_error_added_and_informational_rows() -> None:
    def rs(*recs: dict) -> ResultSet:
        return ResultSet(Path("x"), records=[{**r, "env_id": "e1"} for r in recs])

    ok = measured("probe", "p", "m", "s", "lower", [1.0, 2.0]).to_dict()
    waived = {**not_measured("probe", "p", "m", "waived", "no GPU").to_dict(), "unit": "s",
              "direction": "lower"}
    no_reason = {k: v for k, v in waived.items() if k != "reason"}
    error = {**waived, "status": "error", "reason": "boom"}
    blank = {**ok, "value": None, "samples": []}  # measured nothing, as a torn run can
    (row,) = compare_sets(rs(ok), rs(waived))
    assert (row.verdict, row.marks) == ("unmeasured", ["waived: no GPU"])
    (row,) = compare_sets(rs(ok), rs(no_reason))
    assert row.marks == ["waived: "]
    (row,) = compare_sets(rs(ok), rs(blank, error))
    assert (row.verdict, row.marks) == ("error", ["error: boom"])
    (row,) = compare_sets(rs(waived), rs(ok))
    assert (row.verdict, row.test) == ("added", "")
    diag = measured("probe", "p", "cv", "", "none", [1.0, 1.1]).to_dict()
    (row,) = compare_sets(rs(diag), rs({**diag, "samples": [9.0, 9.9], "value": 9.45}))
    assert (row.test, row.verdict, row.change) == ("informational", "same", None)


def test_run_medians_are_the_units_from_two_runs_against_eight() -> None:
    """2 runs against 8: the smallest p is 2 / C(10, 2) = 0.044 <= 0.05, so the runs are
    the units; 4 against 4 at alpha exactly their smallest p (2 / 70) too."""
    (row,) = compare_sets(runs_of([100.0, 101.0]), runs_of([100.0 + i for i in range(8)]))
    assert row.test == "mann-whitney runs"
    (row,) = compare_sets(runs_of([100.0, 101.0, 99.0, 100.5]),
                          runs_of([100.0, 101.0, 99.0, 100.5]), alpha=min_p_value(4, 4))
    assert row.test == "mann-whitney runs"


def test_noise_applies_to_positive_values_only() -> None:
    from kvbench.noise import Spread
    from kvbench.schema import record_key

    def one(value: float) -> ResultSet:
        rec = measured("run", "r", "q", "", "lower", [value], {}, {"exact": "yes"})
        return ResultSet(Path("x"), records=[{**rec.to_dict(), "env_id": "e1"}])

    noise = {record_key(one(1.0).records[0]): Spread(0.1, 5)}
    (row,) = compare_sets(one(0.5), one(0.5), noise=noise)
    assert row.noise is not None and row.test == "run noise"
    for base, new in ((0.0, 1.0), (1.0, 0.0)):
        (row,) = compare_sets(one(base), one(new), noise=noise)
        assert row.noise is None and row.test == "threshold-only"


def test_format_and_glob_messages_in_full() -> None:
    from kvbench.compare import check_format, check_globs

    check_format("json")
    with pytest.raises(KvbenchError) as e:
        check_format("csv")
    assert str(e.value) == "unknown format 'csv' (table, markdown, json)"
    a, b = ResultSet(Path("a.jsonl"), records=[]), ResultSet(Path("b.jsonl"), records=[])
    with pytest.raises(KvbenchError) as e:
        check_globs(["bw*"], b, a, b)
    assert str(e.value) == "--metric 'bw*' matches no quantity of a.jsonl or b.jsonl"


def test_mann_whitney_caps_and_branches_by_hand() -> None:
    # U at the centre: both tails 2/3, p capped at 1
    assert mann_whitney_p([2.0], [1.0, 3.0]) == 1.0
    # ties, var = 4/12 (5 - 24/12) = 1: z = (|1 - 2| - 0.5) / 1
    assert mann_whitney_p([1.0, 1.0], [1.0, 2.0]) == pytest.approx(
        math.erfc(0.5 / math.sqrt(2)), rel=1e-12)

    def normal(n1: int, n2: int) -> float:  # x all below y: U = 0
        z = (n1 * n2 / 2 - 0.5) / math.sqrt(n1 * n2 / 12 * (n1 + n2 + 1))
        return math.erfc(z / math.sqrt(2))

    below = [float(i) for i in range(100)]
    # exact up to n1 n2 = 2500: 2 / C(n1 + n2, n1); the normal approximation beyond it
    assert mann_whitney_p(below[:50], [100.0 + i for i in range(50)]) == pytest.approx(
        2 / math.comb(100, 50), rel=1e-9, abs=0)  # no absolute slack: p ~ 1e-29
    assert mann_whitney_p(below[:41], [100.0 + i for i in range(61)]) == pytest.approx(
        normal(41, 61), rel=1e-12, abs=0)
    assert mann_whitney_p(below[:51], [100.0 + i for i in range(51)]) == pytest.approx(
        normal(51, 51), rel=1e-12, abs=0)


def test_a_p_value_equal_to_alpha_is_not_significant() -> None:
    base, new = tight(100.0, "higher"), tight(112.0, "higher")
    (row,) = compare_sets(base, new)
    assert row.verdict == "improved" and 0 < row.p_value < 0.05
    (row,) = compare_sets(base, new, alpha=row.p_value)
    assert row.verdict == "noise"


def test_marks_only_where_both_files_hold_the_quantity() -> None:
    a = {**measured("probe", "p", "m", "s", "lower", [1.0, 2.0], version="1").to_dict(),
         "env_id": "e1"}
    b = {**a, "version": "2", "env_id": "e2"}
    (row,) = compare_sets(ResultSet(Path("x"), records=[a]), ResultSet(Path("y"), records=[b]))
    assert row.marks == ["env differs", "version differs"]
    (missing,) = compare_sets(ResultSet(Path("x"), records=[a]),
                              ResultSet(Path("y"), records=[{**b, "metric": "n"}]))[:1]
    assert missing.verdict == "missing" and missing.marks == []
