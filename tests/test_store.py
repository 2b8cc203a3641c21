import json
from pathlib import Path

import pytest

from kvbench.errors import KvbenchError
from kvbench.schema import SCHEMA_VERSION, measured, not_measured
from kvbench.store import ResultWriter, load, to_dataframe

ENV = {"env_id": "abc123", "cpu": {"model": "test"}}


def write_two(path: Path) -> None:
    with ResultWriter(path, ENV, command="kvbench probe x") as w:
        w.write(measured("probe", "x", "bw", "GB/s", "higher", [1.0, 2.0, 3.0], {"size": 4096}))
        w.write(not_measured("probe", "x", "bw", "waived", "no GPU", {"size": 1}))


def test_roundtrip_fills_provenance(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.jsonl"
    write_two(path)
    rs = load(path)
    assert list(rs.envs) == ["abc123"]
    assert rs.warnings == []
    ok, waived = rs.records
    assert ok["schema_version"] == SCHEMA_VERSION
    assert ok["value"] == 2.0 and ok["samples"] == [1.0, 2.0, 3.0]
    assert ok["stats"]["n"] == 3 and ok["provenance"] == "measured"
    assert ok["env_id"] == "abc123" and ok["command"] == "kvbench probe x"
    assert ok["git_commit"] and ok["kvbench_version"] and ok["time"]
    assert waived["status"] == "waived" and waived["reason"] == "no GPU"
    assert waived["value"] is None


def test_env_written_once_per_file(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_two(path)
    write_two(path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert sum(x["kind"] == "env" for x in lines) == 1
    assert len(load(path).records) == 4


def test_records_are_flushed_one_by_one(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    w = ResultWriter(path, ENV)
    w.write(measured("probe", "x", "bw", "GB/s", "higher", [1.0]))
    # readable before the writer is closed: nothing is buffered
    assert len(load(path).records) == 1
    w.close()


def test_torn_last_line_is_reported_and_rest_kept(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_two(path)
    with path.open("a") as fh:
        fh.write('{"schema_version": 1, "kind": "probe", "na')
    rs = load(path)
    assert len(rs.records) == 2
    assert len(rs.warnings) == 1 and "torn last line" in rs.warnings[0]


@pytest.mark.parametrize(("content", "message"), [
    ("hello world\n{}\n", "not kvbench JSON Lines"),
    ('{"a": 1}\n', "not a kvbench record"),
    ('{"schema_version": 99, "kind": "probe"}\n', "schema version 99"),
    ('{"schema_version": 1, "kind": "weird"}\n', "unknown record kind"),
    ('{"schema_version": 1, "kind": "probe", "name": "x"}\n', "lacks"),
    ("", "holds no kvbench records"),
])
def test_bad_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(KvbenchError, match=message):
        load(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KvbenchError, match="does not exist"):
        load(tmp_path / "nope.jsonl")


def test_dataframe(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_two(path)
    df = to_dataframe(load(path).records)
    assert list(df["param.size"]) == [4096, 1]
    assert list(df["n_samples"]) == [3, 0]
    assert df.loc[0, "stats.median"] == 2.0


def test_writer_without_records_leaves_no_file(tmp_path: Path) -> None:
    """A command that fails before its first record (bad input) leaves nothing behind."""
    path = tmp_path / "sub" / "r.jsonl"
    with ResultWriter(path, ENV) as w:
        w.write_batch([])
    assert not path.exists() and not path.parent.exists()


def test_slim_keeps_env_lines_records_and_only_the_named_decode_traces(tmp_path) -> None:
    import json

    from kvbench.store import slim

    rows = [{"kind": "env", "env_id": "e"},
            {"kind": "run", "metric": "tbt", "params": {}},
            {"kind": "run", "metric": "trace.pages", "params": {"phase": "decode"}},
            {"kind": "run", "metric": "trace.pages", "params": {"phase": "prefill"}},
            {"kind": "run", "metric": "trace.tokens", "params": {"phase": "decode"}}]
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = slim([src], tmp_path / "summary.jsonl", ("trace.pages",))
    assert kept == [rows[1], rows[2]]
    out = [json.loads(x) for x in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert out == [rows[0], rows[1], rows[2]]


def test_gzip_records_load_like_plain_ones_and_write_the_same_bytes_twice(tmp_path) -> None:
    """Large committed records are .jsonl.gz: load, slim and report read them as they read
    plain JSON Lines, and slim writes them without a timestamp (no churn in git)."""
    import gzip

    from kvbench.store import slim

    plain = tmp_path / "r.jsonl"
    with ResultWriter(plain, {"env_id": "e"}) as w:
        w.write(measured("probe", "timer", "m", "ns", "lower", [1.0, 2.0, 3.0]))
    first = slim([plain], tmp_path / "a.jsonl.gz", ())
    packed = (tmp_path / "a.jsonl.gz").read_bytes()
    assert slim([plain], tmp_path / "a.jsonl.gz", ()) == first
    assert packed[:2] == b"\x1f\x8b" and packed == (tmp_path / "a.jsonl.gz").read_bytes()
    assert gzip.decompress(packed).decode() == plain.read_text()
    rs = load(tmp_path / "a.jsonl.gz")
    assert [r["samples"] for r in rs.records] == [[1.0, 2.0, 3.0]] and "e" in rs.envs
    (tmp_path / "bad.jsonl.gz").write_bytes(packed[: len(packed) // 2])  # truncated archive
    with pytest.raises(KvbenchError, match="cannot read result file"):
        load(tmp_path / "bad.jsonl.gz")


@pytest.mark.parametrize(("samples", "median"), [
    ([5.0, 1.0, 9.0], 5.0), ([4.0, 1.0, 3.0, 10.0], 3.5), ([7.0], 7.0),
    ([0.5, 0.125, 1.0, 0.25], 0.375), ([2.0, 2.0, 8.0, 8.0, 8.0], 8.0)])
def test_value_is_the_median_of_the_samples(samples: list[float], median: float) -> None:
    """Issue 30: schema.measured's and schema.from_timing's value is the median of the
    samples (the mean of the middle two for an even count), samples kept in order."""
    from kvbench.schema import from_timing
    from kvbench.timing import Timing

    rec = measured("probe", "x", "m", "GB/s", "higher", samples)
    assert (rec.value, rec.samples) == (median, samples)
    assert rec.stats is not None and (rec.stats["median"], rec.stats["n"]) == (median,
                                                                                len(samples))
    assert (rec.stats["min"], rec.stats["max"]) == (min(samples), max(samples))
    t = from_timing("probe", "x", Timing(tuple(samples), "perf_counter_ns", 2), {"a": 1})
    assert (t.value, t.samples, t.unit, t.direction, t.metric) == (median, samples, "s",
                                                                    "lower", "time")
    assert t.method == {"timer": "perf_counter_ns", "warmup": 2, "reps": len(samples),
                        "statistic": "median"} and t.provenance == "measured"


def test_committed_smoke_baseline_is_valid() -> None:
    """The baseline `make bench-check` compares against: one environment, of the machine
    class its folder names, which every record names; measured quantities (the only
    projected ones the roofline's arithmetic intensities, computed by a formula it states);
    every measured value the median of its samples; and every guarded quantity of the smoke
    suite present and measured."""
    import fnmatch
    import statistics

    from kvbench.suite import load_suite, machine_class

    repo = Path(__file__).resolve().parent.parent
    rs = load(repo / "results" / "baselines" / "cpu-2c-x86_64" / "smoke.jsonl")
    assert not rs.warnings and len(rs.envs) == 1
    ((env_id, env),) = rs.envs.items()
    assert machine_class(env) == "cpu-2c-x86_64" and env["cpu"]["logical_cpus"] == 2
    assert env["versions"]["kvbench"] and env["versions"]["torch"]
    assert len(rs.records) > 100 and {r["env_id"] for r in rs.records} == {env_id}
    projected = {(r["name"], r["metric"]) for r in rs.records if r["provenance"] != "measured"}
    assert projected == {("roofline", "intensity")}
    assert all("formula" in r["method"] for r in rs.records if r["provenance"] == "projected")
    ok = [r for r in rs.records if r["status"] == "ok"]
    assert {r["status"] for r in rs.records} == {"ok", "waived"}
    for r in ok:
        assert r["samples"], r
        assert r["value"] == statistics.median(r["samples"]) == r["stats"]["median"], r
        assert r["stats"]["n"] == len(r["samples"])
    for glob in load_suite(repo / "suites" / "smoke.toml").guard:
        hits = [r for r in ok if fnmatch.fnmatch(f"{r['name']}.{r['metric']}", glob)]
        assert hits and all(r["provenance"] == "measured" for r in hits), glob
