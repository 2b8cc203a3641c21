import json
from pathlib import Path

import pytest

from kvbench.errors import KvbenchError
from kvbench.paths import shown
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


@pytest.mark.parametrize(("before", "tail"), [
    (2, '{"schema_version": 1, "kind": "probe", "na'),
    (2, "x" * 70000),  # longer than one read back (64 KiB)
    (2, "x" * 65535),  # the last newline is the first byte of the first block read back
    (300, "x" * 70000),  # whole lines beyond the first block, the newline in the second
    (0, "x" * 65537),  # nothing whole: the file is cut to nothing
])
def test_appending_after_a_torn_line_cuts_it(tmp_path: Path, before: int, tail: str) -> None:
    """A resumed sweep appends after a killed one: the torn fragment is cut first, so the
    new record is a line of its own and the file loads whole, every earlier line kept."""
    path = tmp_path / "r.jsonl"
    if before:
        with ResultWriter(path, ENV) as w:
            for i in range(before):
                w.write(measured("probe", "x", "bw", "GB/s", "higher", [float(i)] * 8))
    whole = path.read_bytes() if before else b""
    with path.open("a") as fh:
        fh.write(tail)
    with ResultWriter(path, ENV) as w:
        w.write(measured("probe", "x", "bw", "GB/s", "higher", [-1.0]))
        w.write(measured("probe", "x", "bw", "GB/s", "higher", [-2.0]))
    assert path.read_bytes().startswith(whole)
    rs = load(path)
    assert [r["value"] for r in rs.records] == [*map(float, range(before)), -1.0, -2.0]
    assert rs.warnings == [] and list(rs.envs) == [ENV["env_id"]]


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


# --- the store's helpers and messages in full (issue 30) ---

def test_git_state_of_this_tree_and_outside_git(tmp_path: Path) -> None:
    import subprocess

    from kvbench.store import REPO_ROOT, git_state

    commit, _ = git_state()
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode == 0:
        assert commit == head.stdout.strip() and len(commit) == 40
    assert git_state(tmp_path) == ("unknown", False)


def test_git_state_dirty_only_for_tracked_changes(tmp_path: Path) -> None:
    import subprocess

    from kvbench.store import git_state

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    commit, dirty = git_state(tmp_path)
    assert len(commit) == 40 and dirty is False
    (tmp_path / "new").write_text("untracked")  # untracked files do not count
    assert git_state(tmp_path) == (commit, False)
    (tmp_path / "f").write_text("b")
    assert git_state(tmp_path) == (commit, True)


def test_default_out_path_is_stamped_and_never_reused(tmp_path: Path, monkeypatch) -> None:
    import datetime as dt
    import types

    import kvbench.store as store

    when = dt.datetime(2026, 1, 2, 3, 4, 5)
    monkeypatch.setattr(store, "dt", types.SimpleNamespace(
        datetime=types.SimpleNamespace(now=lambda: when)))
    monkeypatch.setattr(store, "RESULTS_DIR", tmp_path)
    first = store.default_out_path("bw")
    assert first == tmp_path / "bw-20260102-030405.jsonl"
    first.write_text("x")
    second = store.default_out_path("bw")
    assert second == tmp_path / "bw-20260102-030405-2.jsonl"
    second.write_text("x")
    assert store.default_out_path("bw") == tmp_path / "bw-20260102-030405-3.jsonl"


def test_writer_stamps_the_command_line_and_keeps_a_records_own(tmp_path: Path,
                                                                monkeypatch) -> None:
    import sys

    monkeypatch.setattr(sys, "argv", ["kvbench", "probe", "x", "--out", "a b"])
    path = tmp_path / "r.jsonl"
    with ResultWriter(path, ENV) as w:
        r = measured("probe", "x", "m", "s", "lower", [1.0])
        w.write(r)
        own = measured("probe", "x", "n", "s", "lower", [1.0])
        own.command = "kvbench suite run s.toml"
        w.write_batch([own, measured("probe", "x", "o", "s", "lower", [2.0])])
        assert w.count == 3
    rs = load(path)
    assert [x["command"] for x in rs.records] == ["kvbench probe x --out 'a b'",
                                                  "kvbench suite run s.toml",
                                                  "kvbench probe x --out 'a b'"]
    env = json.loads(path.read_text().splitlines()[0])
    assert env["kind"] == "env" and env["env"] == ENV and env["schema_version"] == 1
    assert env["time"] and rs.records[0]["git_dirty"] in (True, False)


def test_writer_appends_to_a_file_of_another_environment(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_two(path)
    with ResultWriter(path, {"env_id": "other"}, command="c") as w:
        w.write(measured("probe", "x", "bw", "GB/s", "higher", [1.0]))
    rs = load(path)
    assert list(rs.envs) == ["abc123", "other"] and len(rs.records) == 3
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with ResultWriter(empty, ENV, command="c") as w:
        w.write(measured("probe", "x", "bw", "GB/s", "higher", [1.0]))
    assert list(load(empty).envs) == ["abc123"]


@pytest.mark.parametrize(("content", "message"), [
    ("hello world\n{}\n", "'{p}' line 1 is not kvbench JSON Lines"),
    ("\n" + '{"a": 1}\n', "'{p}' line 2 is not a kvbench record"),
    ('{"schema_version": 1}\n', "'{p}' line 1 is not a kvbench record"),
    ('{"schema_version": 99, "kind": "probe"}\n',
     "'{p}' line 1: schema version 99 is not known to kvbench 0.1.0 (knows [1])"),
    ('{"schema_version": 1, "kind": "weird"}\n', "'{p}' line 1: unknown record kind 'weird'"),
    ('{"schema_version": 1, "kind": "run", "name": "x", "metric": "m", "unit": "s"}\n',
     "'{p}' line 1: record lacks direction, value, status, provenance"),
    ("[1, 2]\n[3]\n", "'{p}' line 1 is not kvbench JSON Lines"),
    ("\n\n", "'{p}' holds no kvbench records"),
])
def test_bad_files_messages_in_full(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(KvbenchError) as e:
        load(path)
    assert str(e.value) == message.format(p=path)


def test_env_line_only_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('\n{"schema_version": 1, "kind": "env", "env_id": "e"}\n\n'
                    '{"schema_version": 1, "kind": "env", "env_id": "f", "env": {"a": 1}}\n')
    rs = load(path)
    assert rs.envs == {"e": {}, "f": {"a": 1}} and rs.records == [] and rs.warnings == []
    torn = tmp_path / "t.jsonl"
    write_two(torn)
    with torn.open("a") as fh:
        fh.write('{"schema_version": 1, "kind"\n\n')
    rs = load(torn)
    assert rs.warnings == [f"{torn}:4: torn last line skipped (interrupted write)"]


def test_load_refuses_a_folder(tmp_path: Path) -> None:
    with pytest.raises(KvbenchError) as e:
        load(tmp_path)
    assert str(e.value) == f"result file '{tmp_path}' is not a file"
    with pytest.raises(KvbenchError) as e:
        load(tmp_path / "none.jsonl")
    assert str(e.value) == f"result file '{tmp_path / 'none.jsonl'}' does not exist"


def _suite_rec(case: str | None, status: str = "ok", metric: str = "m", **method) -> dict:
    m = dict(method)
    if case is not None:
        m["suite_case"] = case
    return {"kind": "run", "name": "x", "metric": metric, "status": status, "method": m}


def test_suite_units_and_failed_attempts() -> None:
    from kvbench.store import failed_attempt, finished_units, unit_key

    assert unit_key(_suite_rec(None)) is None
    assert unit_key(_suite_rec("c1")) == "c1"
    assert unit_key(_suite_rec("c1", machine="n2")) == "c1@n2"
    assert unit_key({"method": None}) is None
    assert failed_attempt(_suite_rec("c1", "error", "case"))
    assert not failed_attempt(_suite_rec("c1", "error", "tbt"))  # a quantity's own error
    assert not failed_attempt(_suite_rec("c1", "ok", "case"))
    assert failed_attempt(_suite_rec("c1", partial=True))
    assert not failed_attempt({"status": "ok", "metric": "m"})
    recs = [_suite_rec("a", "error", "case"), _suite_rec("b"), _suite_rec("c", partial=True),
            _suite_rec("d", "waived"), _suite_rec(None)]
    assert finished_units(recs) == {"b", "d"}


def test_superseded_attempts_are_dropped_with_a_warning(tmp_path: Path) -> None:
    from kvbench.store import ResultSet, _drop_superseded

    failed, done, other = (_suite_rec("a", "error", "case"), _suite_rec("a"),
                           _suite_rec("b", "error", "case"))
    rs = ResultSet(tmp_path / "r.jsonl", records=[failed, other, done])
    _drop_superseded(rs)
    assert rs.records == [other, done]
    assert rs.warnings == [f"{tmp_path / 'r.jsonl'}: 1 record(s) of failed or interrupted "
                           "attempts superseded by a resumed run of the same unit"]
    clean = ResultSet(tmp_path / "s.jsonl", records=[other])
    _drop_superseded(clean)
    assert clean.records == [other] and clean.warnings == []
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps({**r, "schema_version": 1, "unit": "", "direction":
                                        "none", "value": None, "provenance": "measured"})
                            + "\n" for r in (failed, done)))
    rs = load(path)
    assert [r["status"] for r in rs.records] == ["ok"] and len(rs.warnings) == 1


def test_check_results_out(tmp_path: Path, monkeypatch) -> None:
    import kvbench.store as store
    from kvbench.store import check_results_out

    check_results_out(tmp_path / "new.jsonl")  # absent: fine
    (tmp_path / "empty.jsonl").write_text("")
    check_results_out(tmp_path / "empty.jsonl")
    good = tmp_path / "good.jsonl"
    write_two(good)
    check_results_out(good)
    blank_first = tmp_path / "blank.jsonl"
    blank_first.write_text("\n\n" + good.read_text())
    check_results_out(blank_first)
    bad = tmp_path / "bad.txt"
    bad.write_text("\nnot json\n")
    with pytest.raises(KvbenchError) as e:
        check_results_out(bad, "--into")
    assert str(e.value) == (f"--into: '{bad}' line 2 is not kvbench JSON Lines (results are "
                            "appended to it)")
    old = tmp_path / "old.jsonl"
    old.write_text('{"schema_version": 7, "kind": "env"}\n')
    with pytest.raises(KvbenchError) as e:
        check_results_out(old)
    assert str(e.value) == (f"--out: '{old}' line 1: schema version 7 is not known to kvbench "
                            "0.1.0 (knows [1]) (results are appended to it)")
    gz = tmp_path / "bad.jsonl.gz"
    gz.write_bytes(b"not gzip at all")
    with pytest.raises(KvbenchError, match=r"^--out: cannot read '.*bad\.jsonl\.gz': .* "
                                           r"\(results are appended to it\)$"):
        check_results_out(gz)
    monkeypatch.setattr(store, "RESULTS_DIR", tmp_path / "results")
    check_results_out(None)  # a folder that can be made


def test_dataframe_columns(tmp_path: Path) -> None:
    rec = {"kind": "probe", "name": "x", "value": 1.0, "params": {"size": 2},
           "stats": {"median": 1.0}, "samples": [1.0, 1.0], "method": {"a": 1}}
    df = to_dataframe([rec, {"kind": "run", "name": "y", "value": None}])
    assert sorted(df.columns) == ["kind", "n_samples", "name", "param.size", "stats.median",
                                  "value"]
    assert list(df["n_samples"]) == [2, 0] and df.loc[1, "name"] == "y"


def test_git_state_of_a_repository_without_commits_or_with_a_broken_index(tmp_path) -> None:
    """Either git call failing makes the state unknown: no commit yet (rev-parse fails,
    status works) or a corrupt index (status fails, rev-parse works)."""
    import subprocess

    from kvbench.store import git_state

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    assert git_state(tmp_path) == ("unknown", False)
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    (tmp_path / ".git" / "index").write_bytes(b"not an index")
    assert git_state(tmp_path) == ("unknown", False)


def test_records_are_compact_json_and_keep_nan(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "r.jsonl"  # folders made as needed
    env = {"env_id": "e", "x": float("nan")}
    with ResultWriter(path, env, command="c") as w:
        w.write_all([measured("probe", "x", "m", "s", "lower", [float("nan")]),
                     measured("probe", "x", "n", "s", "lower", [1.0])])
    first, second, third = path.read_text().splitlines()
    assert first.startswith('{"schema_version":1,"kind":"env","env_id":"e"')
    assert '"x":NaN' in first and second.startswith('{"kind":"probe","name":"x","metric":"m"')
    assert '"samples":[NaN]' in second and ", " not in third
    rs = load(path)
    assert [r["metric"] for r in rs.records] == ["m", "n"] and rs.path == path


def test_load_when_the_os_refuses_to_look(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(KvbenchError) as e:
        load(tmp_path / "f" / "child.jsonl")
    # paths.shown: a long path (pytest-xdist's tmp folders) is cut in the middle
    assert str(e.value) == f"result file '{shown(tmp_path / 'f' / 'child.jsonl')}': Not a " \
                           "directory"


def test_check_results_out_blank_file_and_unusable_paths(tmp_path: Path, monkeypatch) -> None:
    import kvbench.store as store
    from kvbench.store import check_results_out

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    check_results_out(blank)  # nothing but blank lines: appended to as if empty
    (tmp_path / "f").write_text("x")
    with pytest.raises(KvbenchError) as e:
        check_results_out(tmp_path / "f" / "r.jsonl", "--into")
    assert str(e.value) == f"--into '{shown(tmp_path / 'f' / 'r.jsonl')}': Not a directory"
    monkeypatch.setattr(store, "RESULTS_DIR", tmp_path / "f")
    with pytest.raises(KvbenchError) as e:
        check_results_out(None)
    assert str(e.value) == f"the results folder '{shown(tmp_path / 'f')}' is not a folder: " \
                           "give a folder path"


def test_slim_reads_past_a_dropped_trace_and_gzip_has_no_timestamp(tmp_path: Path) -> None:
    from kvbench.store import slim

    rows = [{"kind": "run", "metric": "trace.x", "params": {"phase": "decode"}},
            {"kind": "run", "metric": "tbt", "params": {}}]
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert slim([src, src], tmp_path / "s.jsonl.gz", ()) == [rows[1], rows[1]]
    assert (tmp_path / "s.jsonl.gz").read_bytes()[4:8] == b"\0\0\0\0"  # gzip MTIME 0
