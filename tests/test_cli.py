import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.schema import measured
from kvbench.store import ResultWriter, load


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return int(e.value.code or 0), out, err


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.jsonl"
    with ResultWriter(path, {"env_id": "e"}) as w:
        w.write(measured("probe", "timer", "x", "ns", "lower", [1.0, 2.0]))
    return path


def test_list_json_has_registered_probes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["list", "--json"], capsys)
    assert code == 0
    entries = json.loads(out)
    timer = next(e for e in entries if e["name"] == "timer")
    assert timer["kind"] == "probe" and timer["summary"].startswith("Overhead")


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["list"], capsys)
    assert code == 0 and "timer" in out


def bad_inputs(tmp: Path, good: Path) -> list[tuple[list[str], str]]:
    corrupt = tmp / "corrupt.jsonl"
    corrupt.write_text("this is not json\nnor this\n")
    future = tmp / "future.jsonl"
    future.write_text('{"schema_version": 42, "kind": "env", "env_id": "x"}\n')
    return [
        (["frobnicate"], "No such command"),
        (["probe", "nosuchprobe"], "No such command"),
        (["compare", str(tmp / "missing.jsonl"), str(good)], "does not exist"),
        (["compare", str(corrupt), str(good)], "not kvbench JSON Lines"),
        (["compare", str(good), str(future)], "schema version 42"),
        (["compare", str(good), str(good), "--threshold", "lots"], "cannot parse threshold"),
        (["compare", str(good), str(good), "--format", "xml"], "unknown format"),
        (["probe", "timer", "--calls", "notanumber"], "Invalid value"),
    ]


def test_bad_input_is_one_line_exit_2(tmp_path: Path, good_file: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in bad_inputs(tmp_path, good_file):
        assert_usage_error(cli(argv, capsys), message)


def test_console_script_no_traceback(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("kvbench")
    proc = subprocess.run([str(exe), "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=60)
    assert_usage_error(proc, "does not exist")


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "compare" in out


def test_timer_probe_writes_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["probe", "timer", "--calls", "500", "--reps", "3"], capsys)
    assert code == 0
    (path,) = (tmp_path / "results").glob("timer-*.jsonl")
    assert str(path.relative_to(tmp_path)) in out
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["kind"] == "env"
    recs = {r["metric"]: r for r in lines[1:]}
    assert recs["perf_counter_ns_overhead"]["value"] > 0
    assert recs["perf_counter_ns_overhead"]["method"]["reps"] == 3
    assert recs["cuda_event_floor"]["status"] in ("waived", "ok")


def kvbench(*argv: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("kvbench")
    return subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv, message", [
    (["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "banana"],
     "cannot parse size 'banana'"),
    (["probe", "bandwidth", "--src", "host:0", "--dst", "host:0", "--sizes", "1M",
      "--threads", "0"], "--threads must be at least 1"),
    (["run", "full", "--threads", "-1"], "--threads -1"),
])
def test_rejected_command_draws_and_writes_nothing(tmp_path: Path, argv: list[str],
                                                   message: str) -> None:
    """Bad input: one line, exit 2, no live table on stdout and no result file (issue 11.9)."""
    out = tmp_path / "r.jsonl"
    assert_usage_error(kvbench(*argv, "--out", str(out)), message)
    assert not out.exists()


def test_sigterm_keeps_partial_run(tmp_path: Path) -> None:
    """A scheduler's SIGTERM during decode: the records so far, marked partial, exit 143."""
    out = tmp_path / "r.jsonl"
    exe = Path(sys.executable).with_name("kvbench")
    proc = subprocess.Popen([str(exe), "run", "full", "--weights", "random", "--layers", "1",
                             "--prompt-len", "8", "--gen-len", "4000", "--threads", "1",
                             "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # the line printed as the timed decode starts
        if line.startswith("decoding 4000 steps"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    recs = {r["metric"]: r for r in load(out).records}
    tbt = recs["tbt"]
    done = tbt["params"]["steps_completed"]
    assert 1 <= done < 4000 and len(tbt["samples"]) == done
    assert tbt["method"]["partial"] == f"interrupted by SIGTERM after {done} of 4000 decode steps"
    assert all(r["params"]["steps_completed"] == done for r in recs.values())


# every command that writes a result, with the function that would do its work first
WRITERS = {
    "probe": (["probe", "timer", "--calls", "200", "--reps", "3"],
              "kvbench.probes.timer.TimerProbe.run"),
    "run": (["run", "full", "--weights", "random", "--layers", "1"],
            "kvbench.runtime.command.execute"),
    "suite run": (["suite", "run", "SUITE"], "kvbench.suite.run_suite"),
    "roi": (["roi"], "kvbench.prefix.roi.roi"),
    "plan": (["plan"], "kvbench.plan.plan"),
    "project": (["project", "never-read.jsonl", "--hardware", "a6000-pcie4"],
                "kvbench.hwmodel.project.records"),
}


@pytest.mark.parametrize("command", list(WRITERS))
@pytest.mark.parametrize("where, message", [
    ("/proc/nope/x.jsonl", "cannot write in '/proc'"),
    ("LONG", "File name too long"),
    ("DIR", "is a folder: give a file path"),
])
def test_unusable_out_is_refused_before_any_work(command: str, where: str, message: str,
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """--out is checked first: one line, exit 2, nothing measured or written (it used to
    be checked at the first record, after the whole run, and end in a traceback)."""
    argv, work = WRITERS[command]
    suite = tmp_path / "s.toml"
    suite.write_text('[[case]]\nprobe = "timer"\nparams = { calls = 200, reps = 3 }\n')
    argv = [str(suite) if a == "SUITE" else a for a in argv]
    out = {"LONG": str(tmp_path / ("x" * 300 + ".jsonl")), "DIR": str(tmp_path)}.get(where,
                                                                                    where)
    calls: list[object] = []
    monkeypatch.setattr(work, lambda *a, **k: calls.append(a))
    before = sorted(tmp_path.iterdir())
    line = assert_usage_error(cli([*argv, "--out", out], capsys), message)
    assert line.startswith("kvbench: error: --out '") and not calls
    assert sorted(tmp_path.iterdir()) == before


def test_suite_output_of_the_file_is_checked_too(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\noutput = "/proc/nope/s.jsonl"\n\n[[case]]\nprobe = "timer"\n'
                     'params = { calls = 200, reps = 3 }\n')
    assert_usage_error(cli(["suite", "run", str(suite)], capsys),
                       "the suite's output '/proc/nope/s.jsonl': cannot write in '/proc'")


def test_over_long_input_paths_are_one_line(tmp_path: Path, good_file: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    long = str(tmp_path / ("y" * 5000))
    for argv in (["compare", long, str(good_file)], ["compare", str(good_file), long],
                 ["hardware", "show", "z" * 5000], ["hardware", "show", long + ".toml"],
                 ["suite", "run", long + ".toml"]):
        line = assert_usage_error(cli(argv, capsys))
        assert len(line) < 400, line  # the path is shown shortened


@pytest.mark.parametrize("args, message", [
    (["--calls", "99"], "--calls must be at least 100 (got 99)"),
    (["--calls", "-5"], "--calls must be at least 100 (got -5)"),
    (["--reps", "2"], "--reps must be at least 3 (got 2)"),
    (["--reps", "3.5"], "Invalid value for '--reps'"),
    (["--calls", "1e9999"], "Invalid value for '--calls'"),
])
def test_timer_probe_ranges(args: list[str], message: str, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """The timer probe's options out of range: one line, exit 2, nothing timed or written."""
    calls: list[object] = []
    monkeypatch.setattr("kvbench.probes.timer.TimerProbe.run", lambda *a: calls.append(a))
    out = tmp_path / "t.jsonl"
    assert_usage_error(cli(["probe", "timer", *args, "--out", str(out)], capsys), message)
    assert not calls and not out.exists()


@pytest.mark.parametrize("command", ["probe", "run", "roi", "project"])
def test_out_that_is_not_a_result_file_is_refused_before_any_work(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Results are appended to --out: a file there that is not kvbench JSON Lines used to be
    found out at the first record, after the whole run."""
    argv, work = WRITERS[command]
    out = tmp_path / "notes.txt"
    out.write_text("my notes\nand more\n")
    calls: list[object] = []
    monkeypatch.setattr(work, lambda *a, **k: calls.append(a))
    assert_usage_error(cli([*argv, "--out", str(out)], capsys),
                       f"--out: '{out}' line 1 is not kvbench JSON Lines (results are appended")
    assert not calls
    assert out.read_text() == "my notes\nand more\n"


def test_plan_out_is_a_json_file_it_replaces(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "plan.json"  # its folder is created
    for _ in range(2):
        code, _, _ = run(["plan", "--json", "--out", str(out)], capsys)
        assert code == 0 and json.loads(out.read_text())["provenance"] == "projected"


@pytest.mark.parametrize("command", ["probe", "run", "project"])
def test_unusable_results_folder_is_refused_before_any_work(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Without --out, records go to a new file in results/: a 'results' there that is not
    a folder used to be found out when the first record was written (FileExistsError)."""
    argv, work = WRITERS[command]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").write_text("not a folder\n")
    calls: list[object] = []
    monkeypatch.setattr(work, lambda *a, **k: calls.append(a))
    assert_usage_error(cli(argv, capsys),
                       "the results folder 'results' is not a folder: give a folder path")
    assert not calls
